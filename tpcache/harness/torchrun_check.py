"""The checks ``python -m tpcache.torchrun check`` runs on its group (rank 0, the
coordinator): the model workloads against a full recompute, the ranks' digests, and
with ``--drills`` faults planted through the worker's drills. The transport and the
command line are ``tpcache.torchrun``'s.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from tpcache.coordinator.core import Coordinator
from tpcache.engine.forward import ModelEngine
from tpcache.harness.modelcheck import Workload, run_script, run_workload
from tpcache.lockstep.errors import DivergenceError
from tpcache.model.reference import ModelSpec
from tpcache.workers.spec import CacheSpec


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What every rank of a ``check`` run builds (from the same command line)."""

    model: ModelSpec
    cache: CacheSpec
    capacity: int
    dtype: str
    timeout_s: float
    join_timeout_s: float = 120.0


def run_checks(
    coord: Coordinator, cfg: RunConfig, seed: int, tol: float, drills: bool = False
) -> dict[str, Any]:
    """The model checks of the Ray tests, on this group (with ``drills``, those of
    ``run_drills`` too). Returns the JSON-able verdict."""
    engine = ModelEngine(coord)
    model, out = cfg.model, {}
    runs = {
        "basic": Workload(seed=seed, requests=6),
        "chunked": Workload(seed=seed + 1, requests=6, chunk=6, concurrency=3),
        "evict": Workload(seed=seed + 2, requests=16),
    }
    for name, wl in runs.items():
        rep = run_workload(engine, model, wl, tol=tol, dtype=cfg.dtype, rid_prefix=name)
        out[name] = {**rep.as_dict(), "ok": rep.ok(tol)}
        coord.sync()
    ranks: Any = coord.ranks  # a TorchrunRanks: call_on, world_size
    digests = ranks.call("digest")
    out["digests_equal"] = digests == [coord.mirror.digest()] * ranks.world_size
    infos = ranks.call("info")
    out["tokens_computed"] = [i["tokens_computed"] for i in infos]
    drilled = run_drills(engine, coord, cfg, seed, tol) if drills else {}
    out.update(drilled)
    out["ok"] = bool(
        all(out[name]["ok"] for name in runs)
        and out["digests_equal"]
        and (not drills or (drilled["planted_slot_detected"] and drilled["divergence_caught"]))
        and out["basic"]["hit_tokens"] > 0
        and out["evict"]["evicted_pages"] > 0
    )
    return out


# The worker methods ``run_drills`` calls on a rank: a worker class without them cannot
# run ``--drills`` (``tpcache.torchrun`` refuses it before any rank joins).
DRILLS = ("plant_slot_error", "inject_fault")


def run_drills(
    engine: ModelEngine, coord: Coordinator, cfg: RunConfig, seed: int, tol: float
) -> dict[str, Any]:
    """Faults planted on the last rank through its worker's drills (``--worker``): a wrong
    slot id after its check must show in the logits; a divergence must stop every rank
    at its step. Returns their part of the verdict."""
    model, out = cfg.model, {}
    ranks: Any = coord.ranks  # a TorchrunRanks: call_on, world_size
    coord.reset()
    rng = random.Random(seed)
    prompt = [rng.randrange(model.vocab) for _ in range(24)]
    run_script(engine, model, [[prompt]], tol=tol, dtype=cfg.dtype, rid_prefix="pre")
    ranks.call_on(ranks.world_size - 1, "plant_slot_error", 1)
    bad = run_script(engine, model, [[[*prompt, 1, 2]]], tol=tol, dtype=cfg.dtype, rid_prefix="bad")
    out["planted_slot"] = {"prefix": bad.prefix_lens, "rel_err": bad.max_rel_err}
    out["planted_slot_detected"] = bad.prefix_lens[0] > 0 and bad.max_rel_err > max(2 * tol, 1e-3)
    coord.reset()
    run_script(engine, model, [[prompt]], tol=tol, dtype=cfg.dtype, rid_prefix="again")
    coord.sync()
    # Last: its admit misses the cached prefix on one rank.
    step = coord.stats()["steps_sent"]
    ranks.call_on(ranks.world_size - 1, "inject_fault", step, "corrupt")
    try:
        coord.admit("diverge", [*prompt, 3])
        coord.sync()
        out["divergence_caught"] = False
    except DivergenceError as exc:
        out["divergence_caught"] = exc.step == step and exc.odd_ranks == (ranks.world_size - 1,)
        out["divergence"] = {"step": exc.step, "odd_ranks": list(exc.odd_ranks), "planted": step}
    return out
