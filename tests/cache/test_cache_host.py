"""The host (CPU) tier of the single-process cache: exact state after each move
(write-back, load-back, host eviction, a hit on a node on both tiers) at page sizes 1
and 16, its KV events per medium, its integrity check failing, and bad input refused
before anything changes."""

from __future__ import annotations

import pytest
from cache_helpers import fold_events

from tpcache.cache.errors import (
    HostTierError,
    IntegrityError,
    InvalidSlots,
    LockError,
    UnknownRequest,
)
from tpcache.cache.events import BlockRemoved, BlockStored
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.cache.records import CacheSizes
from tpcache.replay import ReplayOptions, make_cache


def blocks(ps: int, *ids: int) -> list[int]:
    """Whole pages of distinct tokens: page ``i`` is ``100 * i + 1 ..``."""
    return [100 * i + j + 1 for i in ids for j in range(ps)]


def make(ps: int, dev: int = 4, host: int = 4, **kw: object) -> HostCache:
    return HostCache(
        HostConfig(dev * ps, ps, host_capacity_tokens=host * ps, record_events=True, **kw)  # type: ignore[arg-type]
    )


def tiers(cache: HostCache) -> list[tuple[int, str, list[int], list[int]]]:
    """(first token, tier, device pages, host pages) of every node, by first token."""
    out = []
    for n in cache.tree.walk():
        tier = "host" if not n.dev else ("both" if n.host.size else "device")
        out.append((int(n.key[0]), tier, n.pages.tolist() if n.dev else [], n.host.tolist()))
    return sorted(out)


def run(cache: HostCache, rid: int, tokens: list[int]):  # type: ignore[no-untyped-def]
    got = cache.admit(rid, tokens, reserve=1)  # a reserved slot that gets no KV: freed
    cache.check_integrity()
    cache.finish(rid)
    cache.check_integrity()
    return got


@pytest.mark.parametrize("ps", [1, 16])
def test_write_back_load_back_and_host_eviction_exact_state(ps: int) -> None:
    c = make(ps)
    run(c, 1, blocks(ps, 1, 2))  # A: 2 pages; the reserved third is freed
    assert tiers(c) == [(101, "device", [0, 1], [])]
    # B needs 3 pages, 2 are free: A (LRU) is written back to the host, its pages freed.
    run(c, 2, blocks(ps, 3, 4))
    assert tiers(c) == [(101, "host", [], [0, 1]), (301, "device", [3, 2], [])]
    assert c.host.counts()["written_pages"] == 2
    assert c.host.sizes() == CacheSizes(4 * ps, 2 * ps, 2 * ps, 0, 0)
    # A + C: A is on the host only; the admit loads it (B goes to the host for room).
    assert c.admit_prefix_len(blocks(ps, 1, 2, 5)) == 2 * ps
    m = c.match_prefix(blocks(ps, 1, 2, 5))
    assert (m.prefix_len, m.host_hit_length) == (0, 2 * ps)
    got = c.admit(3, blocks(ps, 1, 2, 5), reserve=1)
    assert (got.prefix_len, got.host_hit_length) == (2 * ps, 2 * ps)
    assert got.pages.tolist() == [1, 0, 2, 3]
    c.check_integrity()
    # Exclusive tiers: A's host copy went when it was loaded.
    assert tiers(c) == [(101, "device", [1, 0], []), (301, "host", [], [2, 3])]
    c.finish(3)
    c.check_integrity()
    assert tiers(c) == [
        (101, "device", [1, 0], []),
        (301, "host", [], [2, 3]),
        (501, "device", [2], []),
    ]
    # D needs 4 pages, 1 is free: C then A leave the device. C is written to host page 0;
    # A needs 2 host pages, 1 is free: the host drops B (its LRU host-only leaf).
    run(c, 4, blocks(ps, 6, 7, 8))
    assert tiers(c) == [
        (101, "host", [], [1, 2]),
        (501, "host", [], [0]),
        (601, "device", [3, 0, 1], []),
    ]
    assert c.host.counts() == {
        "written_pages": 7,
        "loaded_pages": 2,
        "host_evicted_pages": 2,
        "copies_started": 5,
        "copies_completed": 5,
    }


@pytest.mark.parametrize("ps", [1, 16])
def test_a_hit_on_a_node_on_both_tiers(ps: int) -> None:
    c = make(ps, write_policy="write_through_selective", write_through_hits=1)
    run(c, 1, blocks(ps, 1, 2))
    assert tiers(c) == [(101, "device", [0, 1], [])]  # no hit yet: no copy
    got = run(c, 2, blocks(ps, 1, 2, 3))  # a hit: A is copied, and stays on the device
    assert got.prefix_len == 2 * ps and got.host_hit_length == 0
    assert tiers(c) == [(101, "both", [0, 1], [0, 1]), (301, "device", [3], [])]
    assert c.host.sizes() == CacheSizes(4 * ps, 2 * ps, 0, 2 * ps, 0)
    m = c.match_prefix(blocks(ps, 1, 2))  # a hit on both tiers is a device hit
    assert (m.prefix_len, m.host_hit_length, m.pages.tolist()) == (2 * ps, 0, [0, 1])
    # Evicting everything: A keeps only its host copy (no second write), C is dropped.
    c.evict(4 * ps)
    c.check_integrity()
    assert tiers(c) == [(101, "host", [], [0, 1])]
    assert c.host.counts()["written_pages"] == 2
    got = c.admit(3, blocks(ps, 1, 2, 9))  # loaded back; write-through keeps the copy
    assert (got.prefix_len, got.host_hit_length) == (2 * ps, 2 * ps)
    c.check_integrity()
    assert tiers(c)[0][1] == "both"
    c.abort(3)
    c.check_integrity()


def test_events_announce_each_medium_separately() -> None:
    ps = 4
    c = make(ps)
    index: dict = {}
    run(c, 1, blocks(ps, 1, 2))
    run(c, 2, blocks(ps, 3, 4))  # A: stored on CPU, then removed from GPU
    events = c.take_events()
    kinds = [(type(e).__name__, e.medium) for e in events]
    assert kinds == [
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
        ("BlockStored", "GPU"),
    ]
    a_hashes = events[0].block_hashes  # type: ignore[union-attr]
    assert events[1].block_hashes == a_hashes and events[2].block_hashes == a_hashes  # type: ignore[union-attr]
    # Per medium, the events fold into exactly what each tier holds.
    fold_events(index, [e for e in events if e.medium == "GPU"], ps)
    assert len(index) == 2
    c.admit(3, blocks(ps, 1, 2, 9))  # load: stored on GPU, removed from CPU
    later = c.take_events()
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in later)
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in later)


def test_lock_on_a_node_that_moved_to_the_host_is_refused() -> None:
    c = make(1)
    run(c, 1, [1, 2, 3])
    m = c.match_prefix([1, 2, 3])
    c.evict(4)
    before = c.digest()
    with pytest.raises(LockError):
        c.lock(m.handle)
    assert c.digest() == before


def test_insert_over_host_nodes_takes_the_lent_pages() -> None:
    c = make(1)
    run(c, 1, [1, 2, 3])
    c.evict(4)
    slots = c.alloc_slots(3)
    with pytest.raises(InvalidSlots):
        c.insert([1, 2, 3], [0, 0, 1])  # not lent (page 0 given twice)
    assert c.insert([1, 2, 3], slots) == 3  # all three were cached (on the host)
    c.check_integrity()
    assert tiers(c) == [(1, "device", slots.tolist(), [])]  # the lent pages, no load
    assert c.host.counts()["loaded_pages"] == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"host_capacity_tokens": 8},  # smaller than one page of 16
        {"host_capacity_tokens": 0},
        {"host_capacity_tokens": 64, "write_policy": "write_around"},
        {"host_capacity_tokens": 64, "write_through_hits": 0},
        {"host_capacity_tokens": 64, "policy": "resight"},
    ],
)
def test_bad_host_configurations_are_typed_errors(kw: dict) -> None:
    with pytest.raises(HostTierError):
        HostConfig(160, 16, **kw)


def test_a_host_tier_with_the_hybrid_cache_is_refused() -> None:
    with pytest.raises(HostTierError):
        make_cache(ReplayOptions(1024, 16, swa_window=64, host_capacity=4096), 1024)
    with pytest.raises(HostTierError):
        HostCache(object())  # type: ignore[arg-type]


def test_integrity_check_fails_on_a_broken_host_state() -> None:
    c = make(1)
    run(c, 1, [1, 2, 3])
    c.evict(4)
    c.check_integrity()
    c.tree.host_pages += 1
    with pytest.raises(IntegrityError, match="host pages"):
        c.check_integrity()
    c.tree.host_pages -= 1
    node = next(iter(c.tree.walk()))
    node.lock = 1
    with pytest.raises(IntegrityError):
        c.check_integrity()


@pytest.mark.parametrize("ps", [1, 16])
def test_deferred_copies_change_no_decision_and_gate_only_the_forward(ps: int) -> None:
    c = make(ps, defer_copies=True, record_copies=True)
    ref = make(ps)  # copies done as they start
    for cache in (c, ref):
        run(cache, 1, blocks(ps, 1, 2))
    # B's admit writes A back (copy 0, still running): B's pages may be A's old ones,
    # so each rank's forward of B waits for its own copy 0 (no load: no agreement).
    got = c.admit(2, blocks(ps, 3, 4), reserve=1)
    ref.admit(2, blocks(ps, 3, 4), reserve=1)
    assert tiers(c) == tiers(ref) and (got.ready_after, c.host.local_after(2)) == (0, 1)
    assert c.host.copies_pending() == 1 and c.host.request_ready(2)
    (copy,) = c.host.take_copies()
    assert (copy.id, copy.to_host, copy.device_pages.tolist(), copy.host_pages.tolist()) == (
        0, True, [0, 1], [0, 1],
    )  # fmt: skip
    before = c.digest()
    for bad in (2, -1, 1.0, True):
        with pytest.raises(HostTierError, match="copies_done"):
            c.host.copies_done(bad)  # type: ignore[arg-type]
    assert c.digest() == before
    c.host.copies_done(1)
    assert c.host.local_after(2) == 0 and c.host.copies_pending() == 0 and c.digest() != before
    c.host.copies_done(0)  # what is known already changes nothing
    c.finish(2)
    ref.finish(2)
    # B is written back (copy 1) to make room, then A loads (copy 2): C waits for both.
    got = c.admit(3, blocks(ps, 1, 2, 5), reserve=1)
    assert (got.host_hit_length, got.ready_after) == (2 * ps, 3)
    assert [(k.id, k.to_host) for k in c.host.take_copies()] == [(1, True), (2, False)]
    c.check_integrity()
    c.host.copies_done(2)
    assert not c.host.request_ready(3) and c.host.ready_after(3) == 3
    c.host.waits.waits[99] = 3  # a request that is not running cannot wait
    with pytest.raises(IntegrityError, match="request 99 waits for 3 copies"):
        c.check_integrity()
    del c.host.waits.waits[99]
    c.abort(3)  # an aborted request waits for nothing
    c.check_integrity()
    assert c.host.copies_pending() == 1


@pytest.mark.parametrize("ps", [1, 16])
def test_a_request_waits_only_for_copies_of_its_own_pages(ps: int) -> None:
    """#19: a request waits only for copies that touch its own row: on every rank
    (``ready_after``) for a load of its prefix, by its own admit or another's; on each
    rank's own engine only (``local_after``) for a write-back still reading a page it was
    given; for nothing if no pending copy touches its pages (1 + a copy's id: waits)."""
    c = make(ps, dev=6, host=8, defer_copies=True, record_copies=True)
    run(c, 1, blocks(ps, 1, 2))  # A on pages 0, 1
    run(c, 2, blocks(ps, 3, 4))  # B on pages 3, 4

    def waits(rid: int) -> tuple[int, int]:
        return c.host.ready_after(rid), c.host.local_after(rid)

    got = c.admit(3, blocks(ps, 5, 6), reserve=1)  # evicts A: copy 0 reads pages 0, 1
    assert (got.pages.tolist(), got.ready_after, waits(3)) == ([2, 5, 0], 0, (0, 1))
    assert c.host.request_ready(3)  # no load: only rank-local ordering, no agreement
    c.host.copies_done(1)
    c.finish(3)
    c.evict(2 * ps)  # B goes to the host: copy 1 reads pages 3, 4
    assert [(k.id, k.to_host, k.device_pages.tolist()) for k in c.host.take_copies()] == [
        (0, True, [0, 1]),
        (1, True, [3, 4]),
    ]
    got = c.admit(4, blocks(ps, 7, 8), reserve=0)  # pages no pending copy touches
    assert (got.pages.tolist(), waits(4), c.host.copies_pending()) == ([1, 0], (0, 0), 1)
    got = c.admit(5, blocks(ps, 9), reserve=0)  # page 3: copy 1 still reads it
    assert (got.pages.tolist(), waits(5)) == ([3], (0, 2))
    c.abort(4)
    c.abort(5)
    got = c.admit(6, blocks(ps, 1, 2, 10), reserve=0)  # loads A into pages 4, 0: copy 2
    assert (got.pages.tolist(), got.host_hit_length, waits(6)) == ([4, 0, 1], 2 * ps, (3, 3))
    # G matches A on the device, still being loaded by F's admit: G waits for that load.
    got = c.admit(7, blocks(ps, 1, 2, 11), reserve=0)
    assert (got.pages.tolist(), got.prefix_len, got.host_hit_length) == ([4, 0, 3], 2 * ps, 0)
    assert waits(7) == (3, 3) and got.ready_after == 3
    c.host.copies_done(2)
    assert not (c.host.request_ready(6) or c.host.request_ready(7))
    c.check_integrity()
    c.host.copies_done(3)
    assert c.host.request_ready(6) and waits(7) == (0, 0)
    assert not (c.host.waits.waits or c.host.waits.local)
    c.check_integrity()


def test_copy_waits_of_an_unknown_request_are_refused() -> None:
    """``ready_after``, ``local_after`` and ``request_ready`` raise ``UnknownRequest`` for
    a request that is not running (finished, aborted, never admitted), pending copies or
    not; nothing changes."""
    c = make(1, defer_copies=True, record_copies=True)
    run(c, 1, blocks(1, 1, 2))
    c.admit(2, blocks(1, 3, 4), reserve=1)  # writes A back: copy 0 pending
    assert (c.host.copies_pending(), c.host.local_after(2)) == (1, 1)
    c.abort(2)
    before = c.digest()
    for rid in (1, 2, 3):
        for ask in (c.host.ready_after, c.host.local_after, c.host.request_ready):
            with pytest.raises(UnknownRequest):
                ask(rid)
    assert c.digest() == before and c.host.copies_pending() == 1


@pytest.mark.parametrize("ps", [1, 16])
def test_a_match_says_how_long_until_a_load_under_way_fills_its_pages(ps: int) -> None:
    """A prefix another request is loading back is on the device at once, but its pages
    hold the KV only when the load is done on every rank: a match of it says how many
    copies that is (``ready_after``), and 0 once they are agreed done."""
    c = make(ps, defer_copies=True, record_copies=True)
    run(c, 1, blocks(ps, 1, 2))
    run(c, 2, blocks(ps, 3, 4))  # A written back to the host (copy 0)
    c.host.copies_done(1)
    assert c.match_prefix(blocks(ps, 1, 2)).host_hit_length == 2 * ps
    got = c.admit(3, blocks(ps, 1, 2, 5), reserve=1)  # loads A back (copies 1, 2)
    assert got.host_hit_length == 2 * ps and got.ready_after == 3
    m = c.match_prefix(blocks(ps, 1, 2))
    assert m.prefix_len == 2 * ps and m.host_hit_length == 0 and m.ready_after == 3
    c.host.copies_done(3)
    assert c.match_prefix(blocks(ps, 1, 2)).ready_after == 0
    assert c.match_prefix(blocks(ps, 9)).ready_after == 0  # nothing matched: nothing to wait
    c.check_integrity()
