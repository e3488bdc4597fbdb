"""The hybrid cache through the op log: a mirror and a rank that replays its ops stay equal.

The coordinator applies every call to its mirror and logs an op; each rank applies the op
with an eviction that repeats the mirror's decision. Under SWA-pool pressure the mirror's
admit evicts with an SWA-only shortfall, which runs the SWA order (tombstoning inner
nodes, deleting leaves, freeing full pages too): a rank that replayed the counts freed
instead ran the full order first and deleted other nodes. These tests drive a mirror and
a replaying rank (no collectives: ``local_evict``) through long random walks and compare
every op's result and the digests after every op; then the same workload on a TP=2 group
of in-process ranks over gloo, and (slow) on Ray ranks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tpcache.cache.allocator import LENT
from tpcache.cache.errors import InvalidTokens, OutOfCapacity
from tpcache.cache.swa.allocator import SwaPool
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig
from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.harness.soak import run_soak
from tpcache.lockstep.oplog import logged_admit, logged_extend
from tpcache.lockstep.ops import Abort, CacheUnfinished, Evict, Finish, pack_tokens
from tpcache.workers.protocol import apply_op, local_evict
from tpcache.workers.spec import CacheSpec

POLICIES = ["lru", "mru", "fifo", "filo", "lfu", "priority"]


def _tok(xs: list[int]) -> bytes:
    return pack_tokens(np.asarray(xs, dtype=np.int32))


class Replay:
    """A mirror and a rank replaying the mirror's ops; ``step`` checks them equal."""

    def __init__(self, config: HybridConfig) -> None:
        self.mirror, self.rank = HybridCache(config), HybridCache(config)
        self.evict = local_evict(self.rank)
        # Admits/extends whose eviction was asked of the SWA pool alone, and of those the
        # ones that freed full pages too (deleted leaves): the case counts cannot replay.
        self.swa_only_asks = 0
        self.swa_only_freeing_full = 0

    def step(self, op, expected=None) -> None:
        got = apply_op(self.rank, op, self.evict)
        if expected is not None:
            assert got == expected, (op, got, expected)
        assert self.rank.digest() == self.mirror.digest(), op

    def admit(self, rid: int, tokens: list[int], priority: int = 0) -> None:
        _, op, expected = logged_admit(self.mirror, rid, tokens, priority, 0, None)
        self.count(op, expected)
        self.step(op, expected)

    def extend(self, rid: int, n: int) -> None:
        _, op, expected = logged_extend(self.mirror, rid, n)
        self.count(op, expected)
        self.step(op, expected)

    def count(self, op, expected) -> None:
        assert expected.evicted_swa_pages >= op.evict_swa_pages  # the ask was met
        if op.evict_pages == 0 and op.evict_swa_pages > 0:
            self.swa_only_asks += 1
            self.swa_only_freeing_full += expected.evicted_pages > 0


def random_walk(policy: str, seed: int, ops: int) -> Replay:
    """Admit / decode / chunk / finish / abort / evict under SWA pressure (page 4, window
    32, full pool 3072 and SWA pool 1536 tokens, requests up to 512)."""
    print(f"hybrid op-log walk: policy {policy}, seed {seed}, {ops} ops")
    rng = random.Random(seed)
    cfg = HybridConfig(3072, 1536, 32, 4, policy, max_request_tokens=512)
    r = Replay(cfg)
    fresh = lambda n: [rng.randrange(1, 30_000) for _ in range(n)]  # noqa: E731
    stems = [fresh(rng.randrange(16, 256)) for _ in range(24)]
    running: dict[int, list[int]] = {}
    nxt = 0
    for _ in range(ops):
        x = rng.random()
        try:
            if x < 0.4 or not running:
                prompt = rng.choice(stems) + fresh(rng.randrange(1, 256))
                r.admit(nxt, prompt, priority=rng.randrange(3))
                running[nxt] = prompt
                nxt += 1
                continue
            rid = rng.choice(list(running))
            if x < 0.7:
                r.extend(rid, rng.randrange(1, 64))
            elif x < 0.78:
                more = fresh(rng.randrange(1, 64))
                r.extend(rid, len(more))
                running[rid] = running[rid] + more
                r.mirror.cache_unfinished(rid, running[rid])
                r.step(CacheUnfinished(rid, _tok(running[rid])))
            elif x < 0.85:
                out = fresh(rng.randrange(0, 30))
                r.mirror.finish(rid, out)
                del running[rid]
                r.step(Finish(rid, _tok(out)))
            elif x < 0.95:
                r.mirror.abort(rid)
                del running[rid]
                r.step(Abort(rid))
            else:
                full, swa = rng.randrange(0, 40) * (rng.random() < 0.3), rng.randrange(1, 40)
                got = r.mirror.evict(full, swa)
                op = Evict(full, swa)
                r.step(op)
                assert got.num_tokens >= 0
        except (OutOfCapacity, InvalidTokens):
            continue
    r.mirror.check_integrity()
    r.rank.check_integrity()
    return r


@pytest.mark.parametrize("policy", POLICIES)
def test_a_rank_replaying_the_op_log_stays_equal_to_the_mirror(policy: str) -> None:
    """Fails if an op carries the counts the mirror's eviction freed instead of what it
    was asked (seed 0 under LRU diverges at about the 2,000th op), or if freeing SWA pages
    depends on the order an eviction visits them."""
    for seed in range(2):
        r = random_walk(policy, seed, 4000)
        # The walk really exercised the case: asks of the SWA pool alone that deleted
        # leaves (freeing full pages), which a rank replaying counts gets wrong.
        print(f"  SWA-only asks {r.swa_only_asks}, {r.swa_only_freeing_full} freed full pages")
        assert r.swa_only_freeing_full > 10, (r.swa_only_asks, r.swa_only_freeing_full)


def test_swa_pages_freed_together_go_back_sorted_and_the_log_sees_which() -> None:
    a, b = SwaPool(16), SwaPool(16)
    for pool in (a, b):
        pool.take(8)
    a.give(np.array([5, 1, 3], dtype=np.int64))
    b.give(np.array([3, 5, 1], dtype=np.int64))
    assert a.free_pages().tolist() == b.free_pages().tolist() == [*range(8, 16), 1, 3, 5]
    assert a.fingerprint() == b.fingerprint()
    # The same count and the same id sum, other pages: the log differs.
    c, d = SwaPool(16), SwaPool(16)
    for pool in (c, d):
        pool.take(8)
    c.give(np.array([1, 4], dtype=np.int64))
    d.give(np.array([2, 3], dtype=np.int64))
    assert c.fingerprint() != d.fingerprint()
    # One page at a time and as a group: different free groups, different logs.
    e = SwaPool(16)
    e.take(8)
    e.give_one(1)
    e.give_one(4)
    assert e.free_pages().tolist() == c.free_pages().tolist()
    assert e.fingerprint() != c.fingerprint()


def test_the_digest_covers_the_swa_free_order() -> None:
    """Two hybrid caches with the same tree and full pool whose SWA pools freed different
    pages (same count, same id sum) have different digests."""
    cfg = HybridConfig(64, 32, 8, 1, "lru")
    x, y = HybridCache(cfg), HybridCache(cfg)
    for c in (x, y):
        c.free_slots(c.alloc_slots(6))
    assert x.digest() == y.digest()
    # Pages 0..5 went back sorted; now free SWA pages {1, 4} in x and {2, 3} in y by
    # lending and returning them in different groups.
    sx, sy = x.alloc_slots(26), y.alloc_slots(26)
    assert (x.alloc.full.tags_of(sx) == LENT).all()
    x.free_slots(sx[[0, 3]])
    y.free_slots(sy[[1, 2]])
    assert x.alloc.swa.free_pages().sum() == y.alloc.swa.free_pages().sum()
    assert x.digest() != y.digest()


def _soak_config(**kw) -> GroupConfig:
    return GroupConfig(
        tp=2,
        capacity_tokens=3072,
        cache=CacheSpec(
            page_size=4,
            policy="lru",
            max_request_tokens=512,
            sliding_window=32,
            swa_capacity_tokens=1536,
        ),
        num_layers=1,
        kv_heads=4,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 24,
        timeout_s=30.0,
        **kw,
    )


def _check_soak(out: dict) -> None:
    print(out)
    assert out["divergences"] == 0
    assert out["no_leak"] and out["rank_digests_equal"]
    assert out["evict_calls"] > 0 and out["evicted_tokens"] > 0 and out["chunked_prefill_calls"] > 0


def test_hybrid_soak_tp2_in_process_ranks() -> None:
    """The issue's soak: 20,000 calls on a TP=2 hybrid group (gloo, ranks in threads)."""
    coord = start_local_group(_soak_config())
    try:
        _check_soak(run_soak(coord, 20_000, seed=1))
    finally:
        coord.close()


@pytest.mark.slow
def test_hybrid_soak_tp2_ray_ranks(ray_cluster) -> None:
    from tpcache.frontend.service import start_group

    coord = start_group(_soak_config())
    try:
        _check_soak(run_soak(coord, 20_000, seed=1))
    finally:
        coord.close()
