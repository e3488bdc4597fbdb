"""The TP model on the pool, in one process: N ranks as threads (``model_helpers``).

The same RankWorker, lockstep protocol, coordinator and engine as under Ray and torchrun;
only the transport and the collectives are in-process. Fast, so it covers the model's
math, the hybrid cache through lockstep, and the checks that must refuse bad commands.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
from drill_worker import DrillWorker
from model_helpers import host_script, local_engine

from tpcache.group.tp_group import GroupInputError, TPGroup
from tpcache.harness.modelcheck import Workload, run_script, run_workload
from tpcache.lockstep.ops import pack_slots, unpack_slots
from tpcache.model.context import ForwardError, build_forward, check_forward
from tpcache.model.reference import (
    ModelConfigError,
    ModelSpec,
    full_weights,
    reference_logits,
    shard_weights,
)
from tpcache.workers.rank import CacheSpec

TOL = 1e-5
MODEL = ModelSpec(seed=21)
HYBRID = ModelSpec(seed=22, num_layers=3, swa_layers=(0, 2), window=8)
BASE_CACHE = CacheSpec(page_size=4, max_request_tokens=64)
HYBRID_CACHE = CacheSpec(
    page_size=4, max_request_tokens=64, sliding_window=8, swa_capacity_tokens=80
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_model_spec_rejects_bad_shapes():
    with pytest.raises(ModelConfigError, match="head_dim"):
        ModelSpec(head_dim=7)
    with pytest.raises(ModelConfigError, match="swa_layers"):
        ModelSpec(swa_layers=(3,), window=4)
    with pytest.raises(ModelConfigError, match="window"):
        ModelSpec(swa_layers=(0,))
    with pytest.raises(ModelConfigError, match="window without"):
        ModelSpec(window=4)
    with pytest.raises(ModelConfigError, match="divide by tp=3"):
        ModelSpec().check_tp(3)


def test_weights_are_seeded_and_shards_reassemble_megatron_style():
    a, b = full_weights(MODEL), full_weights(ModelSpec(seed=21))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["0.wq"], full_weights(ModelSpec(seed=99))["0.wq"])
    shards = [shard_weights(MODEL, r, 4) for r in range(4)]
    for name in ("0.wq", "1.wk", "1.wv", "0.up"):  # column-parallel
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), a[name])
    for name in ("0.wo", "1.down"):  # row-parallel
        assert torch.equal(torch.cat([s[name] for s in shards], dim=0), a[name])
    for name in ("embed", "head", "0.norm1", "norm"):  # replicated
        assert all(torch.equal(s[name], a[name]) for s in shards)


def test_reference_windowed_attention_is_causal_and_local():
    toks = list(range(3, 23))
    full = reference_logits(MODEL, toks)
    # causal: a prefix's logits do not depend on what follows
    assert torch.allclose(reference_logits(MODEL, toks[:7]), full[:7], rtol=0, atol=1e-5)
    win = reference_logits(HYBRID, toks)
    wide = ModelSpec(seed=22, num_layers=3, swa_layers=(0, 2), window=64)
    # a window longer than the sequence is full attention; a short one differs after it
    no_swa = reference_logits(wide, toks)
    assert torch.allclose(win[:9], no_swa[:9], rtol=0, atol=1e-5)
    assert not torch.allclose(win[9:], no_swa[9:], rtol=0, atol=1e-3)
    # with every layer sliding, 3 layers of window 8 reach 24 tokens back, no further
    local = ModelSpec(seed=22, num_layers=3, swa_layers=(0, 1, 2), window=8)
    seq = list(range(3, 33))
    base, changed = reference_logits(local, seq), reference_logits(local, [63, *seq[1:]])
    assert torch.equal(base[25:], changed[25:])
    assert not torch.allclose(base[20], changed[20], atol=1e-4)
    with pytest.raises(ValueError, match="vocab"):
        reference_logits(MODEL, [1, 64])


@pytest.mark.parametrize("tp", [2, 4])  # TP=1 and all of these again: test_model_ray.py
def test_thread_ranks_match_full_recompute(tp):
    seed = 500 + tp
    print(f"seed={seed}")
    eng = local_engine(tp, MODEL, BASE_CACHE, 192)
    for wl in (
        Workload(seed=seed, requests=6),
        Workload(seed=seed + 1, requests=6, chunk=5, concurrency=3),
        Workload(seed=seed + 2, requests=14),
    ):
        rep = run_workload(eng, MODEL, wl, tol=TOL)
        assert rep.ok(TOL), rep
    assert rep.evicted_pages > 0 and rep.hit_tokens > 0
    eng.coord.sync()
    eng.coord.ranks.call("check_integrity")


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_through_lockstep_and_tombstones(tp):
    """The hybrid cache through the op log (SWA evictions agreed, digests equal) and the
    model reading SWA KV only in the window, through a tombstoned prefix."""
    seed = 600 + tp
    print(f"seed={seed}")
    eng = local_engine(tp, HYBRID, HYBRID_CACHE, 512)
    rep = run_script(eng, HYBRID, tombstone_script(seed), tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.tombstoned_hit_pages > 0  # the last request matched through a tombstone
    assert rep.prefix_lens[-1] > HYBRID.window
    assert rep.max_swa_read_over_new <= HYBRID.window
    wl = Workload(seed=seed, requests=12, prefix_len=(12, 24), max_len=40)
    rep = run_workload(eng, HYBRID, wl, tol=TOL)
    assert rep.ok(TOL), rep
    assert rep.evicted_swa_pages > 0
    eng.coord.sync()
    assert eng.coord.ranks.call("digest") == [eng.coord.mirror.digest()] * tp
    eng.coord.ranks.call("check_integrity")


HOST_CACHE = CacheSpec(page_size=4, max_request_tokens=64, host_capacity_tokens=256)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_through_the_host_tier_equals_full_recompute(tp):
    """KV evicted to each rank's host pool and loaded back by its copy engine gives the
    logits of full recompute, and no loaded token is computed again (``rep.ok``)."""
    eng = local_engine(tp, MODEL, HOST_CACHE, 96)
    rep = run_script(eng, MODEL, host_script(700, MODEL.vocab), tol=TOL)
    assert rep.ok(TOL), rep
    counts = eng.coord.mirror.host.counts()
    assert counts["written_pages"] > 0 and counts["loaded_pages"] >= 9  # A's 36 tokens
    assert rep.prefix_lens[3] == 36  # the continuation got A back from the host
    eng.coord.sync()
    assert eng.coord.ranks.call("digest") == [eng.coord.mirror.digest()] * tp
    eng.coord.ranks.call("check_integrity")


def tombstone_script(seed: int) -> list:
    """A shared prefix P (32 tokens) with two branches, a filler that makes the SWA pool
    drop P's SWA KV (P becomes a tombstone), then a continuation of the second branch
    that matches through P (window 8 of SWA KV after it)."""
    rng = random.Random(seed)
    p = [rng.randrange(64) for _ in range(32)]
    filler = [rng.randrange(64) for _ in range(40)]
    return [[[*p, *[5] * 10]], [[*p, *[6] * 10]], [filler], [(1, [7] * 5)]]


def test_planted_wrong_slot_on_one_rank_shows_in_the_logits():
    eng = local_engine(2, MODEL, BASE_CACHE, 192, worker_cls=DrillWorker)
    prompt = list(range(1, 30))
    assert run_script(eng, MODEL, [[prompt]], tol=TOL).ok(TOL)
    eng.coord.ranks.workers[1].plant_slot_error(1)
    bad = run_script(eng, MODEL, [[[*prompt, 4, 5]]], tol=TOL)
    assert bad.prefix_lens == [28]  # the whole pages of the 29-token prompt
    assert bad.max_rel_err > 1e-3 and not bad.ok(TOL)


def test_ranks_refuse_a_forward_that_disagrees_with_their_cache():
    eng = local_engine(2, MODEL, BASE_CACHE, 192)
    eng.coord.admit("x", list(range(1, 20)))
    cmd = build_forward(eng.coord.mirror, "x", list(range(1, 20)))
    ranks = eng.coord.ranks
    check_forward(ranks.workers[0].cache, cmd)  # the mirror's command is the rank's
    slots = unpack_slots(cmd.slots).copy()
    slots[3] += 1
    for bad in (
        msgspec.structs.replace(cmd, slots=pack_slots(slots)),
        msgspec.structs.replace(cmd, start=1),
        msgspec.structs.replace(cmd, rid="nobody"),
        build_forward(eng.coord.mirror, "x", list(range(2, 21))),  # tokens differ
    ):
        with pytest.raises(ForwardError):
            check_forward(ranks.workers[1].cache, bad)
    # one rank given an off-by-one slot: every rank refuses, nobody hangs
    from tpcache.lockstep.ops import encode

    futs = [
        ranks.pool.submit(ranks.workers[0].forward, encode(cmd)),
        ranks.pool.submit(
            ranks.workers[1].forward,
            encode(msgspec.structs.replace(cmd, slots=pack_slots(slots))),
        ),
    ]
    msgs = []
    for f in futs:
        with pytest.raises(ForwardError) as err:
            f.result(timeout=30)
        msgs.append(str(err.value))
    assert "another rank" in msgs[0] and "slots differ" in msgs[1]
    with pytest.raises(ForwardError, match="holds only"):
        build_forward(eng.coord.mirror, "x", list(range(1, 40)))


def test_load_model_checks_the_pool_shape():
    eng = local_engine(2, MODEL, BASE_CACHE, 64)
    worker = eng.coord.ranks.workers[0]
    with pytest.raises(ModelConfigError, match="heads"):
        worker.load_model(ModelSpec(heads=8))
    with pytest.raises(ModelConfigError, match="layers"):
        worker.load_model(ModelSpec(num_layers=3))
    eng = local_engine(1, HYBRID, HYBRID_CACHE, 128)
    with pytest.raises(ModelConfigError, match="window"):
        eng.coord.ranks.workers[0].load_model(
            ModelSpec(seed=22, num_layers=3, swa_layers=(0, 2), window=4)
        )


def test_all_reduce_sum_rejects_non_float_tensors_before_the_collective():
    group = TPGroup(
        None,
        rank=0,
        world_size=1,
        backend="gloo",
        device=torch.device("cpu"),
        timeout_s=1.0,
        where="a test group",
    )
    with pytest.raises(GroupInputError, match="floating-point"):
        group.all_reduce_sum(torch.arange(3))
    with pytest.raises(GroupInputError):
        group.all_reduce_sum(np.zeros(3))  # type: ignore[arg-type]
