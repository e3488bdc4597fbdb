"""torchrun mode: the same ``RankWorker`` as a torchrun rank, without Ray.

    torchrun --standalone --nproc_per_node=2 -m tpcache.torchrun check

Every rank builds its ``RankWorker``, joins the group at torchrun's ``MASTER_ADDR`` /
``MASTER_PORT`` (gloo on CPUs, NCCL on GPUs), agrees the pool capacity and loads the
model. Rank 0 is also the coordinator: a ``Coordinator`` over ``TorchrunRanks``, which
broadcasts every step and every rank call as a ``Command`` (``lead.lead_command``);
the other ranks run ``lead.follow`` until rank 0 sends ``Stop``. Steps are applied
by ``apply_step`` with the same MIN agreements and digest checks as under Ray.

``check`` runs the model checks (``harness.modelcheck``) on the group and prints one
JSON line (``{"tpcache_check": ...}``) from rank 0; the exit code is 0 iff all passed.
With ``--drills`` it also plants faults on the last rank, through a worker class that
has fault drills (``--worker``; the product's ``RankWorker`` has none: the tests'
``drill_worker:DrillWorker`` does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any

import torch

from tpcache.cli.args import add_count_option, seconds_arg
from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.coordinator.step_types import RankCallError
from tpcache.errors import TpcacheError
from tpcache.harness.torchrun_check import DRILLS, RunConfig, run_checks
from tpcache.kv.pool import PoolSpec
from tpcache.lockstep.ops import RunCall, RunStep, Stop
from tpcache.model.reference import ModelSpec
from tpcache.workers.lead import PeerCallError, follow, lead_command
from tpcache.workers.rank import RankWorker
from tpcache.workers.spec import CacheSpec, WorkerSpec


class TorchrunError(TpcacheError, RuntimeError):
    """What a torchrun group cannot do (replace a rank: the job must be restarted)."""


class TorchrunRanks:
    """The ``RankTransport`` of rank 0 under torchrun: commands go out by broadcast.

    Synchronous: ``send`` applies the step on every rank before it returns (the ticket
    holds rank 0's result or its error). Only rank 0's ``StepResult`` comes back: the
    step's digest agreement already made every rank check the others. Replacing a rank
    is not possible inside a torchrun job (``restart`` raises); torchrun restarts jobs.
    """

    def __init__(self, worker: RankWorker, capacity: int) -> None:
        self.worker = worker
        self.world_size = worker.spec.pool.tp
        self.peer_check = True  # rank 0's result only: the ranks check each other
        self.capacity = capacity
        self._closed = False

    def send(self, steps: list[bytes]) -> tuple[bool, Any]:
        out = []
        try:
            group = self._group()
            for data in steps:
                out.append(lead_command(group, self.worker, RunStep(data), self.world_size))
        except Exception as exc:
            return False, exc
        return True, out

    def ready(self, ticket: tuple[bool, Any]) -> bool:
        return True

    def paths(self) -> list[str]:
        return ["torchrun"] * self.world_size

    def collect(self, ticket: tuple[bool, Any], timeout: float) -> list[list[bytes]]:
        ok, value = ticket
        if not ok:
            raise RankCallError(0, value)
        return value

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """``method(*args)`` on every rank (gathered in rank order). Args and results
        travel as msgpack: ints, strs, bytes, lists, dicts."""
        return self._call(RunCall(method, list(args)))

    def call_on(self, rank: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on ``rank`` only (e.g. to plant a fault there)."""
        return self._call(RunCall(method, list(args), rank))[rank]

    def _call(self, cmd: RunCall) -> list[Any]:
        try:
            return lead_command(self._group(), self.worker, cmd, self.world_size)
        except PeerCallError as exc:
            raise RankCallError(exc.rank, exc) from None
        except Exception as exc:
            raise RankCallError(0, exc) from None

    def restart(self, probe_s: float = 2.0) -> int:
        raise TorchrunError("a torchrun job cannot replace its ranks; restart the job")

    def close(self) -> None:
        """Send ``Stop`` to the other ranks (once)."""
        if self._closed:
            return
        self._closed = True
        lead_command(self._group(), self.worker, Stop(), self.world_size)

    def _group(self):
        return self.worker._group()


def env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(f"{name} is not set: start this under torchrun")
    return int(value)


def worker_class(target: str) -> type[RankWorker]:
    """The ``RankWorker`` subclass named ``MODULE:CLASS``; ``TorchrunError`` saying why
    not."""
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TorchrunError(f"--worker {target}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, RankWorker)):
        raise TorchrunError(f"--worker {target}: not a RankWorker subclass")
    return cls


def job_problem(args: argparse.Namespace, cfg: RunConfig, world: int) -> str | None:
    """Why this job cannot run as asked, or None. Every rank decides the same from the
    same command line and ``world`` (torchrun's ``WORLD_SIZE``), before any joins the
    group: a refused job then ends on every rank at once, instead of in a traceback on
    each (or in rank 0's wait for peers that left)."""
    try:
        cls = worker_class(args.worker)
    except TorchrunError as exc:
        return str(exc)
    missing = [m for m in DRILLS if not callable(getattr(cls, m, None))]
    if args.drills and missing:
        return (
            f"--drills plants faults through the worker's {', '.join(missing)}, which "
            f"--worker {args.worker} does not have: give a worker class with fault drills, "
            "e.g. --worker drill_worker:DrillWorker with the repository's tests/support on "
            "PYTHONPATH"
        )
    model = cfg.model
    if model.heads % world or model.ffn % world:
        ways = [n for n in range(1, model.heads + 1) if not model.heads % n and not model.ffn % n]
        return (
            f"{world} ranks (torchrun's --nproc_per_node) cannot split the checked model: "
            f"its {model.heads} KV heads and MLP of {model.ffn} divide over "
            f"{', '.join(map(str, ways))} ranks only; run one of those"
        )
    return None


def say_once(message: str, linger_s: float = 5.0) -> None:
    """``message`` on stderr from rank 0 only (every rank knows it): one line, not one a
    rank. The other ranks wait up to ``linger_s`` before they go on to exit: torchrun
    stops every rank once one exits, and a peer that exits first could stop rank 0
    before its line is out (rank 0's exit then stops them)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"tpcache.torchrun check: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(linger_s)


def start_rank(cfg: RunConfig, worker_cls: type[RankWorker] = RankWorker) -> tuple[RankWorker, int]:
    """Build, join, set up and load the model on this torchrun rank (collective)."""
    rank, world, local = env_int("RANK"), env_int("WORLD_SIZE"), env_int("LOCAL_RANK")
    layers = len(cfg.model.full_layers) if cfg.cache.sliding_window else cfg.model.num_layers
    spec = WorkerSpec(
        pool=PoolSpec(layers, cfg.model.heads, cfg.model.head_dim, world, cfg.dtype),
        cache=cfg.cache,
        capacity_tokens=cfg.capacity,
        cpu_budget_bytes=1 << 28,
        timeout_s=cfg.timeout_s,
        join_timeout_s=cfg.join_timeout_s,
    )
    worker = worker_cls(rank, spec, local)
    worker.join(os.environ.get("MASTER_ADDR", "127.0.0.1"), env_int("MASTER_PORT"))
    capacity = worker.setup()
    worker.load_model(cfg.model)
    return worker, capacity


def coordinator(worker: RankWorker, capacity: int, cache: CacheSpec) -> Coordinator:
    """Rank 0's coordinator over the torchrun group (no recovery: see ``TorchrunRanks``)."""
    fields = CoordinatorConfig.__dataclass_fields__
    config = CoordinatorConfig(**({"auto_recover": False} if "auto_recover" in fields else {}))
    return Coordinator(TorchrunRanks(worker, capacity), cache.build(capacity), config)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tpcache.torchrun",
        description="Run tpcache as a torchrun job, without Ray: every torchrun rank holds "
        "its head shard of the KV pool and a mirror of the cache, and rank 0 also "
        "coordinates, broadcasting each step to the others (gloo on CPUs, NCCL on GPUs). "
        "Start it under torchrun: `torchrun --standalone --nproc_per_node=2 -m "
        "tpcache.torchrun check`.",
    )
    sub = p.add_subparsers(dest="mode", required=True)
    what = (
        "check a small tensor-parallel decoder run over the cache against a full "
        "recompute without it (whole prompts, chunked prefill, eviction pressure), and "
        "with --drills that a wrong slot and a divergence planted on one rank are caught; "
        "prints one JSON line and exits 0 if every check held"
    )
    c = sub.add_parser("check", help=what, description=what[0].upper() + what[1:] + ".")
    _add_model_options(c)
    _add_cache_options(c)
    c.add_argument(
        "--timeout-s",
        type=seconds_arg,
        default=120.0,
        help="seconds any one collective may take before the job fails (default 120)",
    )
    c.add_argument(
        "--worker",
        default="tpcache.workers.rank:RankWorker",
        help="the rank worker class, MODULE:CLASS, a RankWorker subclass (default the product's)",
    )
    c.add_argument(
        "--drills",
        action="store_true",
        help="also plant a wrong slot and a divergence on the last rank and check both are "
        "caught (needs a worker with fault drills, e.g. the tests' drill_worker:DrillWorker)",
    )
    c.add_argument(
        "--join-timeout-s",
        type=seconds_arg,
        default=120.0,
        help="seconds for every rank to join the group (default 120)",
    )
    return p.parse_args(argv)


def _add_model_options(c: argparse.ArgumentParser) -> None:
    """The checked model's options: its seed, its dtype and the error that passes."""
    c.add_argument(
        "--seed", type=int, default=0, help="seed of the model and the workloads (default 0)"
    )
    c.add_argument(
        "--dtype",
        default=None,
        help="model and KV dtype: float32 (default on CPUs) or bfloat16 (default on GPUs)",
    )
    c.add_argument(
        "--tol",
        type=float,
        default=None,
        help="largest relative error against the full recompute that passes (default "
        "1e-5 in float32, 1e-2 in bfloat16)",
    )


def _add_cache_options(c: argparse.ArgumentParser) -> None:
    """The cache's options: pages, the pool, and the sliding window."""
    add_count_option(c, "--page-size", 4, "tokens per cache page")
    add_count_option(
        c, "--capacity", 192, "KV-pool tokens per rank, small so that the eviction workload evicts"
    )
    c.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window in tokens: check the hybrid full + sliding-window cache, on a "
        "model with sliding-window layers (default: full attention only)",
    )
    add_count_option(c, "--swa-capacity", 64, "sliding-window KV pool in tokens, with --window")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    tol = args.tol or (1e-5 if dtype == "float32" else 1e-2)
    hybrid = args.window is not None
    model = ModelSpec(
        seed=args.seed + 1000,
        num_layers=3 if hybrid else 2,
        swa_layers=(0, 2) if hybrid else (),
        window=args.window,
    )
    cache = CacheSpec(
        page_size=args.page_size,
        max_request_tokens=64,
        sliding_window=args.window,
        swa_capacity_tokens=args.swa_capacity if hybrid else None,
    )
    cfg = RunConfig(model, cache, args.capacity, dtype, args.timeout_s, args.join_timeout_s)
    if (problem := job_problem(args, cfg, env_int("WORLD_SIZE"))) is not None:
        say_once(problem)
        return 2
    started = time.perf_counter()
    worker, capacity = start_rank(cfg, worker_class(args.worker))
    try:
        if worker.rank != 0:
            follow(worker._group(), worker, worker.rank, worker.spec.pool.tp)
            return 0
        coord = coordinator(worker, capacity, cache)
        try:
            out = run_checks(coord, cfg, args.seed, tol, args.drills)
        finally:
            coord.ranks.close()
        out.update(
            world_size=worker.spec.pool.tp,
            backend=worker.group.backend if worker.group else None,
            device=str(worker.device),
            dtype=dtype,
            tol=tol,
            seed=args.seed,
            timeout_s=worker.spec.timeout_s,
            join_timeout_s=worker.spec.join_timeout_s,
            seconds=round(time.perf_counter() - started, 2),
        )
        print(json.dumps({"tpcache_check": out}), flush=True)
        return 0 if out["ok"] else 1
    finally:
        worker.shutdown()


if __name__ == "__main__":
    sys.exit(main())
