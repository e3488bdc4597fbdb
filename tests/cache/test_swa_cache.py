"""Scenarios of the hybrid (full + SWA) cache with exact trees, tombstones, locks, sizes,
slot ids and events. Page size 1 unless said; ``view`` rows are (tokens, full pages,
SWA pages or None for a tombstone, lock, SWA lock)."""

from __future__ import annotations

import pytest
from swa_helpers import hybrid, pools, run, snapshot, view

from tpcache.cache.errors import LockError, OutOfCapacity, StaleBoundary
from tpcache.cache.events import BlockRemoved, BlockStored
from tpcache.cache.swa.config import SwaEvictResult
from tpcache.cache.tree.hashing import block_hashes

R = lambda a, b: list(range(a, b + 1))  # noqa: E731  (inclusive token ranges read best here)


def _forked_with_tombstone():
    """[1..6] tombstoned under a locked [7..10] and an unlocked [20..23]; window 4."""
    c = hybrid(64, 64, window=4)
    a = run(c, "a", R(1, 10))
    assert (a.prefix_len, a.pages.tolist(), a.swa_pages.tolist()) == (0, R(0, 9), R(0, 9))
    b = run(c, "b", R(1, 6) + R(20, 23))
    assert (b.prefix_len, b.pages.tolist()) == (6, R(0, 5) + R(10, 13))
    assert (b.swa_pages.tolist(), b.swa_start) == (R(2, 5) + R(10, 13), 2)  # the last window on
    hx = c.match_prefix(R(1, 10)).handle
    c.lock(hx)  # SWA-locks only [7..10]: it is a whole window
    c.match_prefix(R(1, 6) + R(20, 23))  # [1..6] and [20..23] now share the newest tick
    c.take_events()
    tomb = c.tree.walk()[0]
    assert c.evict(0, 1) == SwaEvictResult(num_tokens=0, num_nodes=0, swa_tokens=6, tombstoned=1)
    # No match may end in the tombstone: its blocks are announced removed (its full KV
    # stays for matches that run through it).
    assert c.take_events() == [BlockRemoved(block_hashes=block_hashes(tomb.states).tolist())]
    assert view(c) == [
        (R(1, 6), R(0, 5), None, 1, 0),
        (R(7, 10), R(6, 9), R(6, 9), 1, 1),
        (R(20, 23), R(10, 13), R(10, 13), 0, 0),
    ]
    assert pools(c) == ((50, 4, 10, 0), (56, 4, 4, 0), 1, 6)
    c.check_integrity()
    return c, hx


def test_match_runs_through_a_tombstone_when_a_window_follows_it() -> None:
    c, _ = _forked_with_tombstone()
    m = c.match_prefix([*R(1, 10), 99])
    assert (m.prefix_len, m.pages.tolist(), m.swa_pages.tolist(), m.swa_start) == (
        10,
        R(0, 9),
        R(6, 9),
        6,
    )
    m = c.match_prefix(R(1, 6) + R(20, 24))
    assert (m.prefix_len, m.slots.tolist(), m.swa_slots.tolist()) == (
        10,
        R(0, 5) + R(10, 13),
        R(10, 13),
    )
    got = c.admit("q", R(1, 6) + R(20, 23) + [99])
    assert (got.prefix_len, got.pages.tolist(), got.swa_pages.tolist()) == (
        10,
        R(0, 5) + R(10, 13) + [14],
        R(10, 14),
    )
    assert got.swa_start == 6 and got.swa_slots.tolist() == R(10, 14)
    c.check_integrity()


@pytest.mark.parametrize(
    "tokens",
    [[*R(1, 6), 20, 21, 22], [*R(1, 6), 20, 21, 22, 98], R(1, 6), [*R(1, 6), 99], R(1, 3)],
)
def test_no_match_ends_at_a_tombstone_or_less_than_a_window_after_it(tokens: list[int]) -> None:
    c, _ = _forked_with_tombstone()
    m = c.match_prefix(tokens)
    assert (m.prefix_len, m.pages.tolist(), m.swa_pages.tolist()) == (0, [], [])
    assert m.handle.node_id == 0
    got = c.admit("q", [*tokens, 99])
    assert got.prefix_len == 0 and got.pages.tolist() == R(14, 14 + len(tokens))
    c.check_integrity()


def _chain(b: int):
    """A(4) T1(2) B(b) T2(2) C(2) D(2), T1 and T2 tombstones, A and D locked; window 4.

    FIFO orders by insertion tick, then id: three turns of a conversation store A+T1,
    B+T2, C+D; splitting each gives the upper half the higher id, so the SWA order is
    T1, A, T2, B, D, C, and with A and C+D SWA-locked it takes exactly T1 and T2.
    """
    a, t1, t2, cc = 4, 2, 2, 2
    s = R(1, a + t1 + b + t2 + cc + 2)
    c = hybrid(64, 64, window=4, policy="fifo")
    for rid, end in (("a", a + t1), ("b", a + t1 + b + t2), ("c", len(s))):
        run(c, rid, s[:end])
    for cut in (a, a + t1 + b, a + t1 + b + t2 + cc):
        assert c.match_prefix([*s[:cut], 99]).prefix_len == cut
    c.lock(c.match_prefix(s[:a]).handle)  # SWA-locks A: a whole window
    hd = c.match_prefix(s).handle
    c.lock(hd)  # SWA-locks D and C: four tokens
    assert c.evict(0, 4) == SwaEvictResult(0, 0, 4, 2)  # T1, then T2
    tombs = [(n.key.tolist(), n.tombstone) for n in c.tree.walk()]
    assert [t for _, t in tombs] == [False, True, False, True, False, False]
    c.check_integrity()
    return c, s, hd


@pytest.mark.parametrize(("b", "expect"), [(2, 4), (4, 10)])
def test_the_count_since_a_tombstone_restarts_at_every_tombstone(b: int, expect: int) -> None:
    # After the second tombstone, C (2 tokens) is shorter than the window. A matcher that
    # does not restart its count at T2 would add B's tokens and end the match after C.
    c, s, _ = _chain(b)
    a, t1, t2, cc = 4, 2, 2, 2
    after_c = a + t1 + b + t2 + cc
    assert c.match_prefix([*s[:after_c], 99]).prefix_len == expect
    assert c.admit("q", [*s[:after_c], 99]).prefix_len == expect
    # Through both tombstones, D ends a full window (C + D) after T2.
    assert c.match_prefix([*s, 99]).prefix_len == len(s)
    assert c.match_prefix([*s[: a + t1 + b], 99]).prefix_len == expect
    c.check_integrity()


def test_insert_over_a_tombstone_revives_it_with_the_newcomers_swa_kv() -> None:
    c, hx = _forked_with_tombstone()
    got = run(c, "c", R(1, 6) + R(30, 34))
    assert got.prefix_len == 0  # the match could not end at the tombstone
    # Full pages 14..24; SWA pages 14..24 (0..5, freed by the tombstone, queue behind).
    assert (got.pages.tolist(), got.swa_pages.tolist()) == (R(14, 24), R(14, 24))
    # The tombstone keeps its full pages and takes the newcomer's SWA pages 14..19; the
    # newcomer's full pages 14..19 were duplicates and are free again.
    assert view(c) == [
        (R(1, 6), R(0, 5), R(14, 19), 1, 0),
        (R(7, 10), R(6, 9), R(6, 9), 1, 1),
        (R(20, 23), R(10, 13), R(10, 13), 0, 0),
        (R(30, 34), R(20, 24), R(20, 24), 0, 0),
    ]
    assert pools(c) == ((45, 9, 10, 0), (45, 15, 4, 0), 0, 0)
    events = c.take_events()
    u = c.tree.walk()[0]
    assert events == [
        BlockStored(  # the revived tombstone's blocks may end a match again
            block_hashes=block_hashes(u.states).tolist(),
            parent_block_hash=None,
            token_ids=R(1, 6),
            block_size=1,
        ),
        BlockStored(
            block_hashes=block_hashes(c.tree.walk()[3].states).tolist(),
            parent_block_hash=int(block_hashes(u.states)[-1]),
            token_ids=R(30, 34),
            block_size=1,
        ),
    ]
    m = c.match_prefix([*R(1, 6), 99])
    assert (m.prefix_len, m.swa_pages.tolist()) == (6, R(16, 19))  # its last window
    # The full FIFO holds 25..63 then the duplicates 14..19; the SWA FIFO 25..63 then 0..5.
    s = c.alloc_slots(41)
    assert s[-3:].tolist() == [63, 14, 15]
    assert c.swa.slots(s)[-3:].tolist() == [63, 0, 1]
    c.free_slots(s)
    c.unlock(hx)
    c.check_integrity()


def test_deleting_a_leaf_cascades_through_parents_that_can_no_longer_be_matched() -> None:
    # A(4) -> T(2, tombstone) -> B(2) -> {C(2), E(2)}; window 4.
    c = hybrid(64, 64, window=4)
    run(c, "c", R(1, 10))
    run(c, "e", [*R(1, 8), 20, 21])
    assert c.match_prefix([*R(1, 6), 99]).prefix_len == 6
    assert c.match_prefix([*R(1, 4), 99]).prefix_len == 4
    hc = c.match_prefix(R(1, 10)).handle
    he = c.match_prefix([*R(1, 8), 20, 21]).handle
    c.lock(hc)
    c.lock(he)
    assert c.evict(0, 1) == SwaEvictResult(0, 0, 2, 1)  # T: its SWA KV was used longest ago
    c.unlock(hc)
    c.unlock(he)
    assert view(c) == [
        (R(1, 4), R(0, 3), R(0, 3), 0, 0),
        ([5, 6], [4, 5], None, 0, 0),
        ([7, 8], [6, 7], [6, 7], 0, 0),
        ([9, 10], [8, 9], [8, 9], 0, 0),
        ([20, 21], [10, 11], [10, 11], 0, 0),
    ]
    stored = {n.key[0].item(): block_hashes(n.states).tolist() for n in c.tree.walk()}
    c.take_events()
    assert c.evict(2) == SwaEvictResult(2, 1, 2, 0)  # C, the older leaf; B keeps E
    # E goes; B is then a leaf two tokens after a tombstone: it goes, and so does T.
    assert c.evict(2) == SwaEvictResult(6, 3, 4, 0)
    assert view(c) == [(R(1, 4), R(0, 3), R(0, 3), 0, 0)]
    assert c.take_events() == [
        BlockRemoved(block_hashes=stored[9]),
        BlockRemoved(block_hashes=stored[20]),
        BlockRemoved(block_hashes=stored[7]),
    ]  # T ([5, 6]) was announced removed when it was tombstoned
    assert pools(c) == ((60, 4, 0, 0), (60, 4, 0, 0), 0, 0)
    c.check_integrity()


def test_tombstoning_deletes_the_leaves_it_leaves_unmatchable() -> None:
    # [1..6] with children [20..23] (locked) and [7, 8]: tombstoning [1..6] leaves [7, 8]
    # two tokens after a tombstone, so it is deleted with it; [20..23] stays.
    c = hybrid(64, 64, window=4)
    run(c, "a", [*R(1, 6), *R(20, 23)])
    run(c, "b", R(1, 8))
    h = c.match_prefix([*R(1, 6), *R(20, 23)]).handle
    c.lock(h)
    c.match_prefix(R(1, 8))  # [1..6] and [7, 8] share the newest tick; [1..6] has the lower id
    assert c.evict(0, 1) == SwaEvictResult(2, 1, 8, 1)  # [7, 8] goes whole, [1..6] loses SWA
    assert view(c) == [(R(1, 6), R(0, 5), None, 1, 0), (R(20, 23), R(6, 9), R(6, 9), 1, 1)]
    c.unlock(h)
    c.check_integrity()


def test_swa_lock_boundary_survives_a_split() -> None:
    c = hybrid(64, 64, window=4)
    run(c, "x", R(1, 10))
    h = c.match_prefix(R(1, 10)).handle
    c.lock(h)
    assert view(c) == [(R(1, 10), R(0, 9), R(0, 9), 1, 1)]
    assert pools(c) == ((54, 0, 10, 0), (54, 0, 10, 0), 0, 0)
    # A split under the lock: the boundary mark moves to the upper half.
    assert c.match_prefix([*R(1, 7), 99]).prefix_len == 7
    upper, lower = c.tree.walk()
    assert (upper.mark, lower.mark, lower.id) == (h.swa_boundary, 0, h.node_id)
    assert view(c) == [(R(1, 7), R(0, 6), R(0, 6), 1, 1), ([8, 9, 10], [7, 8, 9], [7, 8, 9], 1, 1)]
    # The same prefix matched now ends at the lower half (3 tokens < window) with the
    # boundary on the upper one: the very same handle.
    assert c.match_prefix(R(1, 10)).handle == h
    c.check_integrity()
    c.unlock(h)  # stops at the upper half, where the lock stopped
    assert view(c) == [(R(1, 7), R(0, 6), R(0, 6), 0, 0), ([8, 9, 10], [7, 8, 9], [7, 8, 9], 0, 0)]
    assert pools(c) == ((54, 10, 0, 0), (54, 10, 0, 0), 0, 0)
    c.check_integrity()


def test_a_short_path_is_swa_locked_whole_and_a_long_one_only_in_its_window() -> None:
    c = hybrid(64, 64, window=4)
    run(c, "a", [1, 2])
    run(c, "b", [1, 2, 3, 4, 5, 6, 7])
    h = c.match_prefix([1, 2, 3]).handle  # splits [3..7]
    c.lock(h)
    assert view(c) == [
        ([1, 2], [0, 1], [0, 1], 1, 1),
        ([3], [2], [2], 1, 1),
        ([4, 5, 6, 7], [3, 4, 5, 6], [3, 4, 5, 6], 0, 0),
    ]
    h2 = c.match_prefix(R(1, 7)).handle
    c.lock(h2)  # [4..7] is a whole window
    assert [(v[3], v[4]) for v in view(c)] == [(2, 1), (2, 1), (1, 1)]
    c.unlock(h)
    c.unlock(h2)
    c.check_integrity()


def test_evict_meets_the_full_target_then_the_swa_target() -> None:
    c = hybrid(64, 64, window=2)
    run(c, "s1", R(1, 6))
    run(c, "s2", [1, 2, 3, 7, 8, 9])
    run(c, "s3", R(10, 13))
    c.take_events()
    before = {n.key[0].item(): block_hashes(n.states).tolist() for n in c.tree.walk()}
    # Full order: [4..6] (oldest leaf) meets 3. SWA order: [1..3] is tombstoned (6), then
    # leaf [7..9] goes (9 >= 8), and [1..3], a tombstone leaf now, goes with it.
    assert c.evict(3, 8) == SwaEvictResult(num_tokens=9, num_nodes=3, swa_tokens=9, tombstoned=1)
    assert view(c) == [(R(10, 13), R(9, 12), R(9, 12), 0, 0)]
    # [1..3] is announced removed when tombstoned, not again when deleted.
    assert c.take_events() == [BlockRemoved(block_hashes=before[k]) for k in (4, 1, 7)]
    assert pools(c) == ((60, 4, 0, 0), (60, 4, 0, 0), 0, 0)
    c.check_integrity()


@pytest.mark.parametrize(
    ("full", "swa", "expect"),
    [
        (0, 3, SwaEvictResult(3, 1, 3, 0)),
        (0, 4, SwaEvictResult(3, 1, 6, 1)),
        (0, 0, SwaEvictResult(0, 0, 0, 0)),
    ],
)
def test_swa_eviction_deletes_leaves_and_tombstones_inner_nodes(full, swa, expect) -> None:
    c = hybrid(64, 64, window=2)
    run(c, "s1", R(1, 6))
    run(c, "s2", [1, 2, 3, 7, 8, 9])
    assert c.evict(full, swa) == expect
    c.check_integrity()


def test_admit_evicts_the_swa_shortfall_and_pairs_pages_from_both_fifos() -> None:
    c = hybrid(32, 12, window=4)
    run(c, "a", R(1, 8))
    got = c.admit("b", R(20, 27))  # SWA: 4 free, 8 needed: the cached [1..8] goes
    assert (got.pages.tolist(), got.swa_pages.tolist()) == (R(8, 15), [8, 9, 10, 11, 0, 1, 2, 3])
    assert view(c) == []
    assert pools(c) == ((24, 0, 0, 8), (4, 0, 0, 8), 0, 0)
    before = snapshot(c)
    with pytest.raises(OutOfCapacity, match="SWA 4 free"):
        c.admit("c", R(40, 47))
    assert snapshot(c) == before
    c.finish("b")
    assert view(c) == [(R(20, 27), R(8, 15), [8, 9, 10, 11, 0, 1, 2, 3], 0, 0)]
    c.check_integrity()


def test_chunked_prefill_moves_both_locks_page4() -> None:
    c = hybrid(64, 64, window=8, page_size=4)
    got = c.admit("r", R(1, 10))
    assert (got.prefix_len, got.pages.tolist()) == (0, [0, 1, 2])
    c.extend("r", 6)
    assert c.cache_unfinished("r", R(1, 14)) == 12
    assert view(c) == [(R(1, 12), [0, 1, 2], [0, 1, 2], 1, 1)]
    c.extend("r", 8)
    assert c.cache_unfinished("r", R(1, 24)) == 24
    # The lock moved to [13..24]: a 12-token node covers the 8-token window alone.
    assert view(c) == [
        (R(1, 12), [0, 1, 2], [0, 1, 2], 1, 0),
        (R(13, 24), [3, 4, 5], [3, 4, 5], 1, 1),
    ]
    c.check_integrity()
    assert c.finish("r", []) == 24
    assert [(v[3], v[4]) for v in view(c)] == [(0, 0), (0, 0)]
    c.check_integrity()


def test_unlock_with_a_stale_boundary_or_without_a_lock_is_a_typed_error() -> None:
    c = hybrid(64, 64, window=4)
    run(c, "x", R(1, 10))
    h = c.match_prefix(R(1, 10)).handle
    c.lock(h)
    before = snapshot(c)
    stale = type(h)(h.node_id, h.owner, h.swa_boundary + 1000)
    with pytest.raises(StaleBoundary):
        c.unlock(stale)
    with pytest.raises(StaleBoundary):
        c.lock(stale)
    c.admit("r", [*R(1, 10), 5])  # a request's lock on the same node
    c.unlock(h)
    before = snapshot(c)
    with pytest.raises(LockError, match="not locked"):
        c.unlock(h)  # the request's lock is not the handle's
    assert snapshot(c) == before
    c.check_integrity()


def test_lock_fails_when_the_window_lost_its_swa_kv_since_the_match() -> None:
    c = hybrid(64, 64, window=4)
    run(c, "a", R(1, 10))
    run(c, "b", R(1, 6) + R(20, 23))
    h = c.match_prefix(R(1, 6)).handle  # ends at [1..6], a whole window
    c.lock(c.match_prefix(R(1, 10)).handle)
    c.match_prefix(R(1, 6) + R(20, 23))
    assert c.evict(0, 1).tombstoned == 1  # [1..6]
    before = snapshot(c)
    with pytest.raises(LockError, match="lost its SWA KV"):
        c.lock(h)
    assert snapshot(c) == before
    c.check_integrity()
