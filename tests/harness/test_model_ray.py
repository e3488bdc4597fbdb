"""Proof that cached KV is right, across processes: the TP model on Ray rank actors.

For random prompts sharing random prefixes, at TP=1, 2 and 4, every logit row the ranks
compute from the pool equals full recompute without a cache (``reference_logits``)
within 1e-5, and so does every greedy token; the cache was really used (hits counted,
and no token computed twice). The same with chunked prefill, under eviction pressure,
and with the hybrid cache (window smaller than the shared prefixes). A wrong slot id on
one rank shows up. One group per configuration for the whole module (reset per test).
"""

from __future__ import annotations

import dataclasses
import random

import msgspec
import numpy as np
import pytest
import torch
from drill_worker import DrillWorker
from model_helpers import host_script

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.engine.forward import ModelEngine
from tpcache.frontend.service import GroupConfig, start_group
from tpcache.harness.modelcheck import Workload, run_script, run_workload
from tpcache.lockstep.ops import encode, pack_slots, unpack_slots
from tpcache.model.context import ForwardError, build_forward
from tpcache.model.llama import LlamaReference, LlamaSpec
from tpcache.model.reference import ModelSpec, reference_logits
from tpcache.workers.rank import CacheSpec

TOL = 1e-5
PAGE = 4
MODEL = ModelSpec(seed=31)  # 2 full-attention layers, 4 heads of 8
HYBRID = ModelSpec(seed=32, num_layers=3, swa_layers=(0, 2), window=8)
_NO_RECOVERY = (
    {"auto_recover": False} if "auto_recover" in CoordinatorConfig.__dataclass_fields__ else {}
)


def group_config(tp: int, kind: str, dtype: str = "float32") -> GroupConfig:
    hybrid, host = kind == "hybrid", kind == "host"
    model = HYBRID if hybrid else MODEL
    cache = CacheSpec(
        page_size=PAGE,
        max_request_tokens=64,
        sliding_window=HYBRID.window if hybrid else None,
        swa_capacity_tokens=80 if hybrid else None,
        host_capacity_tokens=256 if host else None,
    )
    return GroupConfig(
        tp=tp,
        # base: 192 tokens, pressure by design; host: 96, most of it written back
        capacity_tokens=512 if hybrid else 96 if host else 192,
        cache=cache,
        num_layers=len(model.full_layers) if hybrid else model.num_layers,
        kv_heads=model.heads,
        head_dim=model.head_dim,
        dtype=dtype,
        cpu_budget_bytes=1 << 24,
        timeout_s=60.0,
        coordinator=CoordinatorConfig(**_NO_RECOVERY),
    )


@pytest.fixture(scope="module")
def engines(ray_cluster):
    """``get(tp, kind)``: the module's engine for that group, its cache reset."""
    made: dict[tuple[int, str], ModelEngine] = {}

    def get(tp: int, kind: str = "base") -> ModelEngine:
        if (tp, kind) not in made:
            coord = start_group(group_config(tp, kind), worker_cls=DrillWorker)
            coord.ranks.call("load_model", HYBRID if kind == "hybrid" else MODEL)
            made[tp, kind] = ModelEngine(coord)
        eng = made[tp, kind]
        eng.coord.reset()
        eng.coord.sync()
        return eng

    yield get
    for eng in made.values():
        eng.coord.close()


def computed_on_ranks(eng: ModelEngine) -> list[int]:
    return [info["tokens_computed"] for info in eng.coord.ranks.call("info")]


def check_clean(eng: ModelEngine) -> None:
    """Ranks agree with the mirror and pass their integrity walk; nothing is running."""
    eng.coord.sync()
    tp = eng.coord.ranks.world_size
    assert eng.coord.ranks.call("digest") == [eng.coord.mirror.digest()] * tp
    eng.coord.ranks.call("check_integrity")
    assert eng.coord.stats()["running"] == 0
    assert eng.coord.stats()["divergences"] == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cached_logits_equal_full_recompute(engines, tp):
    seed = 7000 + tp
    print(f"seed={seed}")
    eng = engines(tp)
    before = computed_on_ranks(eng)
    rep = run_workload(eng, MODEL, Workload(seed=seed, requests=6), tol=TOL)
    assert rep.max_rel_err <= TOL, rep.worst
    assert rep.greedy_checked >= 15 and rep.greedy_mismatches == 0
    assert rep.hit_tokens > 0 and rep.hit_tokens == sum(rep.prefix_lens)
    # prefix tokens were not recomputed: each rank computed exactly the rest
    assert rep.computed_tokens == rep.prompt_tokens + rep.decode_tokens - rep.hit_tokens
    after = computed_on_ranks(eng)
    assert [a - b for a, b in zip(after, before, strict=True)] == [rep.computed_tokens] * tp
    assert rep.evicted_pages == 0
    # exact hits: a request continuing a finished one reuses its prompt and decoded KV
    rng = random.Random(f"script-{seed}")  # not the workload's draws
    prompt = [rng.randrange(MODEL.vocab) for _ in range(29)]
    rep = run_script(eng, MODEL, [[prompt], [(0, [1, 2, 3])]], tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.prefix_lens == [0, 32]  # 29 + 3 decoded = 32 tokens cached, 8 pages
    assert rep.computed_tokens == 29 + 3 + (35 - 32) + 3
    check_clean(eng)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_chunked_prefill_equals_full_recompute(engines, tp):
    seed = 7100 + tp
    print(f"seed={seed}")
    eng = engines(tp)
    rep = run_workload(eng, MODEL, Workload(seed=seed, requests=6, chunk=6, concurrency=3), tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.items > rep.requests * (1 + 3)  # really chunked
    assert rep.forwards < rep.items and rep.max_batch >= 2  # and batched
    # a request admitted while another is mid-prefill hits its unfinished chunks
    rng = random.Random(f"script-{seed}")  # not the workload's draws
    p = [rng.randrange(MODEL.vocab) for _ in range(30)]
    rep = run_script(eng, MODEL, [[p, [*p, 9, 9]]], chunk=8, tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.prefix_lens == [0, 4]  # the first chunk of 8, cached unfinished: 1 page usable
    check_clean(eng)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_eviction_pressure_recomputes_never_reads_stale(engines, tp):
    seed = 7200 + tp
    print(f"seed={seed}")
    eng = engines(tp)
    rep = run_workload(eng, MODEL, Workload(seed=seed, requests=16, prefixes=6), tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.evicted_pages > 0 and rep.hit_tokens > 0
    # a prefix pushed out by fillers is recomputed (at slots that held other KV)
    rng = random.Random(f"script-{seed}")  # not the workload's draws
    p = [rng.randrange(MODEL.vocab) for _ in range(28)]
    fillers = [[[rng.randrange(MODEL.vocab) for _ in range(50)]] for _ in range(4)]
    rep = run_script(eng, MODEL, [[p], *fillers, [[*p, 1]]], tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.evicted_pages > 0
    assert rep.prefix_lens[-1] < 28
    check_clean(eng)


def tombstone_script(seed: int) -> list:
    """Shared prefix P (32 tokens, window 8) with two branches; a filler that makes the
    SWA pool drop P's SWA KV (P becomes a tombstone); then a continuation of the second
    branch that matches through P and reads only the window after it."""
    rng = random.Random(f"script-{seed}")  # not the workload's draws
    p = [rng.randrange(64) for _ in range(32)]
    filler = [rng.randrange(64) for _ in range(40)]
    return [[[*p, *[5] * 10]], [[*p, *[6] * 10]], [filler], [(1, [7] * 5)]]


def test_kv_through_ray_ranks_host_tier_equals_full_recompute(engines):
    """TP=2 Ray ranks (TP=1, 2, 4 on thread ranks: test_model_unit.py): KV written back to
    each rank's host pool and loaded back by its copy engine gives full recompute's
    logits, and none of it is computed again."""
    eng = engines(2, "host")
    rep = run_script(eng, MODEL, host_script(710, MODEL.vocab), tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.prefix_lens[3] == 36 and eng.coord.mirror.host.counts()["loaded_pages"] >= 9
    check_clean(eng)
    # Every rank knows what the mirror knows (started, agreed); a last write-back no
    # forward needed may still be unagreed (nothing asked for it) or running.
    mirror = eng.coord.mirror
    started, agreed = mirror.host.counts()["copies_started"], mirror.host.copies_completed()
    got = [i["copies"] for i in eng.coord.ranks.call("info")]
    assert [c[:2] for c in got] == [[started, agreed]] * 2
    assert all(agreed <= c[2] <= started for c in got)


def test_host_tier_with_a_slow_copy_rank_equals_full_recompute(engines):
    """#19: a page freed while its write-back still reads it on a slow rank goes to the
    next admit at once, and that request's forward is not held back for an agreement;
    each rank's forward waits for its own copy engine instead. Were it not to, rank 1's
    forward would overwrite the page before its write-back read it, and the host copy
    loaded back later would give wrong logits."""
    eng = engines(2, "host")
    eng.coord.ranks.call_on(1, "copy_drill", 0.15, [])
    try:
        rep = run_script(eng, MODEL, host_script(711, MODEL.vocab), tol=TOL)
    finally:
        eng.coord.ranks.call_on(1, "copy_drill", 0.0, [])
    assert rep.ok(TOL), rep
    assert eng.coord.mirror.host.counts()["loaded_pages"] >= 9
    check_clean(eng)


def test_hybrid_cache_equals_windowed_full_recompute(engines):
    seed = 7300
    print(f"seed={seed}")
    eng = engines(2, "hybrid")
    rep = run_script(eng, HYBRID, tombstone_script(seed), tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.tombstoned_hit_pages > 0 and rep.prefix_lens[-1] > HYBRID.window
    assert rep.max_swa_read_over_new <= HYBRID.window
    wl = Workload(seed=seed, requests=12, prefix_len=(12, 24), max_len=40, chunk=7)
    rep = run_workload(eng, HYBRID, wl, tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.evicted_swa_pages > 0 and rep.hit_tokens > 0
    check_clean(eng)


def test_planted_wrong_slot_on_one_rank_fails_the_comparison(engines):
    eng = engines(2)
    prompt = list(range(1, 30))
    assert run_script(eng, MODEL, [[prompt]], tol=TOL).ok(TOL)
    eng.coord.ranks.call_on(1, "plant_slot_error", 1)
    bad = run_script(eng, MODEL, [[[*prompt, 4, 5]]], tol=TOL)
    assert bad.prefix_lens == [28]
    assert bad.max_rel_err > 1e-3 and not bad.ok(TOL)


def test_wrong_slot_sent_to_one_rank_is_refused_by_all(engines, ray_cluster):
    eng = engines(2)
    prompt = list(range(1, 20))
    eng.coord.admit("x", prompt)
    cmd = build_forward(eng.coord.mirror, "x", prompt)
    slots = unpack_slots(cmd.slots).copy()
    slots[5] += 1
    bad = msgspec.structs.replace(cmd, slots=pack_slots(slots))
    actors = eng.coord.ranks.actors
    refs = [actors[0].forward.remote(encode(cmd)), actors[1].forward.remote(encode(bad))]
    for ref in refs:
        with pytest.raises(ForwardError, match="refused"):
            ray_cluster.get(ref, timeout=60)
    # the group is fine afterwards
    out = eng.forward("x", prompt)
    assert out.computed == len(prompt)
    eng.finish("x")
    check_clean(eng)


# ---- GPU (CUDA + NCCL), bf16 -------------------------------------------------------------
GPU_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_bf16_cached_logits_equal_full_recompute(ray_cluster, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    seed = 7400 + tp
    print(f"seed={seed}")
    coord = start_group(group_config(tp, "base", dtype="bfloat16"))
    try:
        assert coord.ranks.use_gpus
        coord.ranks.call("load_model", MODEL)
        eng = ModelEngine(coord)
        for wl in (
            Workload(seed=seed, requests=6),
            Workload(seed=seed + 1, requests=6, chunk=6, concurrency=3),
            Workload(seed=seed + 2, requests=16),
        ):
            rep = run_workload(eng, MODEL, wl, tol=GPU_TOL, dtype="bfloat16")
            print(rep.as_dict())
            assert rep.ok(GPU_TOL), rep
        assert rep.evicted_pages > 0
        check_clean(eng)
    finally:
        coord.close()


def test_a_forward_flushes_steps_waiting_in_the_coordinator(engines):
    """With every in-flight slot taken, an admit's step waits in the coordinator
    (coalescing); the forward that reads its slots must send it first."""
    eng = engines(2)
    coord = eng.coord
    old = coord.config
    coord.config = dataclasses.replace(old, max_inflight=1, coalesce=4)
    try:
        slow = coord.stats()["steps_sent"]
        coord.ranks.call_on(0, "inject_fault", slow, "sleep", 1.5)
        coord.admit("slow", list(range(1, 10)))  # sent at once; rank 0 sleeps on it
        prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
        coord.admit("y", prompt)
        assert coord.stats()["waiting"] == 1  # its step was not sent: the slot is taken
        out = eng.forward("y", prompt)  # would reach the ranks before the admit unflushed
        want = reference_logits(MODEL, prompt, "float32").numpy()
        assert out.logits.shape == want.shape
        assert float(np.abs(out.logits - want).max()) <= TOL * float(np.abs(want).max())
        coord.finish("y")
        coord.finish("slow")
    finally:
        coord.config = old
    check_clean(eng)


def test_a_runner_named_in_the_group_config_runs_batched_on_ray_ranks(ray_cluster):
    """GroupConfig(runner=...): every Ray rank builds the Llama-style runner in its own
    process (grouped-query attention, 4 query heads over 2 KV heads), the pool shaped by
    its layout; batched forwards over the step channel equal full recompute."""
    seed = 7500
    print(f"seed={seed}")
    args = {"seed": seed, "heads": 4, "kv_heads": 2, "hidden": 32, "ffn": 64, "vocab": 64}
    cfg = dataclasses.replace(
        group_config(2, "base"), runner="tpcache.model.llama:LlamaRunner", runner_args=args
    )
    assert cfg.worker_spec().pool.kv_heads == 2  # the runner's, not the config's 4
    coord = start_group(cfg)
    try:
        eng = ModelEngine(coord)
        ref = LlamaReference(LlamaSpec.from_args(**args))
        wl = Workload(seed=seed, requests=8, chunk=6, concurrency=3)
        rep = run_workload(eng, ref, wl, tol=TOL)
        assert rep.ok(TOL), rep
        assert rep.hit_tokens > 0 and rep.forwards < rep.items and rep.greedy_checked > 0
        assert computed_on_ranks(eng) == [rep.computed_tokens] * 2
        check_clean(eng)
    finally:
        coord.close()
