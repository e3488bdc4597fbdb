"""Batched exactness: the cached path equals full recompute, for both shipped runners.

Every forward is one batch over a wave's requests (prefill chunks and decodes mixed);
every logit row each rank computed from the pool equals the runner's full recompute
without a cache within 1e-5, every judged greedy token too, no token is computed twice,
and the cache was really used (hits, evictions, tombstoned SWA matches). TP=1, 2 and 4,
ranks as threads over a real gloo group.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from runner_helpers import (
    LLAMA,
    REFERENCE,
    base_cache,
    hybrid_cache,
    model_args,
    reference_of,
    runner_engine,
)

from tpcache.engine.forward import Decode, Prefill
from tpcache.harness.modelcheck import Workload, run_script, run_workload
from tpcache.model.reference import ModelSpec

TOL = 1e-5
# The reference: 4 heads of 8 (multi-head attention). Llama: 8 query heads over 4 KV
# heads (groups of 2), so TP=4 keeps one KV head per rank.
RUNNERS = {
    "reference": (REFERENCE, model_args(ModelSpec(seed=51))),
    "llama": (LLAMA, {"seed": 52, "hidden": 48, "heads": 8, "kv_heads": 4, "ffn": 96, "vocab": 64}),
}
HYBRID = {
    "reference": (REFERENCE, model_args(ModelSpec(seed=53, num_layers=3, swa_layers=(0, 2), window=8))),
    "llama": (
        LLAMA,
        {"seed": 54, "heads": 8, "kv_heads": 4, "vocab": 64, "num_layers": 3,
         "swa_layers": [0, 2], "window": 8},
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_clean(eng, tp: int) -> None:
    coord = eng.coord
    coord.sync()
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * tp
    coord.ranks.call("check_integrity")
    assert coord.stats()["running"] == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", ["reference", "llama"])
def test_batched_forwards_equal_full_recompute(name, tp):
    seed = 8000 + 10 * tp + (name == "llama")
    print(f"seed={seed}")
    runner, args = RUNNERS[name]
    ref = reference_of(runner, args)
    eng = runner_engine(tp, runner, args, base_cache(), 192)
    try:
        runs = {
            "basic": Workload(seed=seed, requests=6, concurrency=3),
            "chunked": Workload(seed=seed + 1, requests=6, chunk=5, concurrency=3),
            "evict": Workload(seed=seed + 2, requests=16, concurrency=3),
        }
        reps = {k: run_workload(eng, ref, wl, tol=TOL) for k, wl in runs.items()}
        for k, rep in reps.items():
            assert rep.ok(TOL), (k, rep)
            assert rep.greedy_mismatches == 0 and rep.greedy_checked > 0
            assert rep.forwards < rep.items  # batched: several requests per forward
        assert reps["basic"].hit_tokens > 0
        assert reps["chunked"].items > reps["chunked"].requests * 3  # really chunked
        assert reps["evict"].evicted_pages > 0
        assert eng.counters.max_batch == 3
        computed = sum(r.computed_tokens for r in reps.values())
        assert [i["tokens_computed"] for i in eng.coord.ranks.call("info")] == [computed] * tp
        check_clean(eng, tp)
    finally:
        eng.coord.close()


def tombstone_script(seed: int) -> list:
    """A shared prefix P (32 tokens, window 8) with two branches, a filler that makes the
    SWA pool drop P's SWA KV (P becomes a tombstone), then a continuation of the second
    branch that matches through P and reads only the window after it."""
    rng = random.Random(seed)
    p = [rng.randrange(64) for _ in range(32)]
    filler = [rng.randrange(64) for _ in range(40)]
    return [[[*p, *[5] * 10]], [[*p, *[6] * 10]], [filler], [(1, [7] * 5)]]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", ["reference", "llama"])
def test_batched_hybrid_cache_equals_windowed_recompute(name, tp):
    seed = 8100 + 10 * tp + (name == "llama")
    print(f"seed={seed}")
    runner, args = HYBRID[name]
    ref = reference_of(runner, args)
    eng = runner_engine(tp, runner, args, hybrid_cache(8), 512)
    try:
        rep = run_script(eng, ref, tombstone_script(seed), tol=TOL)
        assert rep.ok(TOL), rep
        assert rep.tombstoned_hit_pages > 0 and rep.prefix_lens[-1] > 8
        assert rep.max_swa_read_over_new <= 8
        wl = Workload(seed=seed, requests=12, prefix_len=(12, 24), max_len=40, chunk=7)
        rep = run_workload(eng, ref, wl, tol=TOL)
        assert rep.ok(TOL), rep
        assert rep.evicted_swa_pages > 0 and rep.hit_tokens > 0 and rep.forwards < rep.items
        check_clean(eng, tp)
    finally:
        eng.coord.close()


@pytest.mark.parametrize("name", ["reference", "llama"])
def test_sliding_layers_without_an_swa_pool_read_their_window_from_the_full_pool(name):
    """A model with sliding-window layers on the one-pool cache: every layer's KV in the
    full pool, a sliding layer reads only the window before the first new token."""
    seed = 8200 + (name == "llama")
    print(f"seed={seed}")
    runner, args = HYBRID[name]
    ref = reference_of(runner, args)
    eng = runner_engine(2, runner, args, base_cache(), 192)
    try:
        wl = Workload(seed=seed, requests=10, prefix_len=(12, 24), max_len=40, chunk=5)
        rep = run_workload(eng, ref, wl, tol=TOL)
        assert rep.ok(TOL), rep
        assert rep.hit_tokens > 0 and rep.forwards < rep.items
        check_clean(eng, 2)
    finally:
        eng.coord.close()


def test_last_position_logits_are_the_last_rows_of_all_logits():
    """A step without ``all_logits`` returns each request's last row only: the same
    numbers as that row of a full-row step (prefills and decodes mixed)."""
    runner, args = RUNNERS["llama"]
    ref = reference_of(runner, args)
    eng = runner_engine(2, runner, args, base_cache(), 192)
    try:
        a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]
        first = eng.step([Prefill("a", a), Prefill("b", b)])
        assert [o.logits.shape for o in first] == [(1, 64), (1, 64)]
        want = [ref.full_logits(a, "float32")[-1], ref.full_logits(b, "float32")[-1]]
        for o, w in zip(first, want, strict=True):
            assert float(np.abs(o.logits[0] - w).max()) <= TOL * float(np.abs(w).max())
        eng.finish("b")  # its whole page (4 tokens) is cached
        c = [*b, 9, 9]
        second = eng.step([Decode("a", 5), Prefill("c", c)], all_logits=True)
        assert [(o.rid, o.prefix_len, o.start) for o in second] == [("a", 0, 8), ("c", 4, 4)]
        assert [o.logits.shape for o in second] == [(1, 64), (4, 64)]
        for got, want in (
            (second[0].logits, ref.full_logits([*a, 5], "float32")[8:]),
            (second[1].logits, ref.full_logits(c, "float32")[4:]),
        ):
            assert float(np.abs(got - want).max()) <= TOL * float(np.abs(want).max())
        # Each rank counted both forwards, their 14 + 1 + 4 tokens, and time inside run.
        for times in eng.coord.ranks.call("model_times"):
            assert (times["forwards"], times["tokens"]) == (2, 19)
            assert times["run_wall_s"] > 0 and 0 < times["run_cpu_s"] <= times["process_cpu_s"]
    finally:
        eng.coord.close()
