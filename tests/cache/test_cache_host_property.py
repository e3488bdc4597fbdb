"""The host tier under seeded random ops (the determinism test's ops): after every op the
integrity check passes, the KV events folded per medium equal what each tier holds, an
admit takes what ``admit_prefix_len`` said just before, and two caches fed the same ops
agree on every result and digest. The seed is printed, so a failure can be replayed."""

from __future__ import annotations

import random

import pytest
from test_cache_determinism import apply, random_ops

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.cache.host.config import WRITE_POLICIES
from tpcache.cache.tree.hashing import block_hashes


def make(ps: int, policy: str, write: str, defer: bool = False) -> HostCache:
    return HostCache(
        HostConfig(
            12 * ps,
            ps,
            policy,
            host_capacity_tokens=10 * ps,
            write_policy=write,
            write_through_hits=1,
            record_events=True,
            record_copies=defer,
            defer_copies=defer,
        )
    )


def fold(index: dict[str, set[int]], events: list[KVEvent]) -> None:
    """Apply events per medium, as a router that tracks tiers does: a store adds blocks
    new to its medium, under a parent known on some medium; a removal names exactly
    blocks stored on its medium."""
    for ev in events:
        match ev:
            case BlockStored(block_hashes=hashes, parent_block_hash=parent, medium=medium):
                known = index["GPU"] | index["CPU"]
                assert parent is None or parent in known, f"unknown parent {parent}"
                assert not set(hashes) & index[medium], f"stored twice on {medium}"
                index[medium] |= set(hashes)
            case BlockRemoved(block_hashes=hashes, medium=medium):
                assert set(hashes) <= index[medium], f"removal of blocks not on {medium}"
                index[medium] -= set(hashes)
            case AllBlocksCleared():
                index["GPU"].clear()
                index["CPU"].clear()


def tier_hashes(cache: HostCache) -> tuple[set[int], set[int]]:
    """Block hashes on the device and on the host, read from the tree."""
    dev: set[int] = set()
    host: set[int] = set()
    for node in cache.tree.walk():
        hashes = set(block_hashes(node.states).tolist())
        if node.dev:
            dev |= hashes
        if node.host.size:
            host |= hashes
    return dev, host


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("write", WRITE_POLICIES)
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority"])
def test_random_ops_keep_the_host_tier_whole_and_deterministic(
    policy: str, write: str, ps: int
) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed} policy={policy} write={write} page_size={ps}")
    a, b = make(ps, policy, write), make(ps, policy, write)
    index: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    moved = 0
    for step, op in enumerate(random_ops(seed, ps, 300)):
        want = a.admit_prefix_len(op[2]) if op[0] == "admit" and op[2] else None
        got = apply(a, op)
        assert apply(b, op) == got, f"step {step}: {op}"
        if want is not None and isinstance(got, list):
            assert got[0] == want, f"step {step}: admit took {got[0]}, probe said {want}"
        a.check_integrity()
        assert a.digest() == b.digest(), f"step {step}: {op}"
        fold(index, a.take_events())
        b.take_events()
        assert (index["GPU"], index["CPU"]) == tier_hashes(a), f"step {step}: {op}"
        moved = max(moved, a.host.counts()["copies_started"])
    print(f"copies started: {moved}")
    assert moved > 0  # the ops did reach the host tier


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("write", WRITE_POLICIES)
def test_deferred_completion_changes_no_decision(write: str, ps: int) -> None:
    """Copies completed at random later points (as a lockstep agrees them) change no
    result of any op; the copy log numbers every copy in order; a request is ready
    exactly when the copies it waits for are done. A sequence whose requests never had
    a copy to wait for checks nothing of that: more sequences run until one has (about
    1 seed in 75 alone has none)."""
    seed = random.randrange(2**32)
    taken = waited = 0
    for attempt in range(8):
        got = _deferred_run(write, ps, seed + attempt)
        taken, waited = taken + got[0], waited + got[1]
        if taken > 0 and waited > 0:
            break
    assert taken > 0 and waited > 0


def _deferred_run(write: str, ps: int, seed: int) -> tuple[int, int]:
    """One sequence of ``test_deferred_completion_changes_no_decision``: (copies taken,
    request checks that had a copy to wait for)."""
    print(f"seed={seed} write={write} page_size={ps}")
    rng = random.Random(seed)
    a, d = make(ps, "lru", write), make(ps, "lru", write, defer=True)
    taken = waited = 0
    for step, op in enumerate(random_ops(seed, ps, 300)):
        assert apply(d, op) == apply(a, op), f"step {step}: {op}"
        ids = [c.id for c in d.host.take_copies()]
        assert ids == list(range(taken, taken + len(ids)))
        taken += len(ids)
        if rng.random() < 0.3:
            d.host.copies_done(rng.randint(d.host.copies_completed(), taken))
        d.check_integrity()
        for rid in d.running_ids():
            waits, local = d.host.ready_after(rid), d.host.local_after(rid)
            assert d.host.request_ready(rid) == (waits <= d.host.copies_completed())
            assert local >= waits  # a rank's own engine does the loads too
            waited += local > d.host.copies_completed()
    print(f"copies: {taken}, request checks with a copy to wait for: {waited}")
    return taken, waited
