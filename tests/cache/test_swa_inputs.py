"""The hybrid cache's typed errors on bad input (state unchanged), ``check_integrity()``
on planted corruption, and the paired allocator."""

from __future__ import annotations

import numpy as np
import pytest
from swa_helpers import hybrid, run, snapshot, view

from tpcache.cache.allocator import CACHED, HELD
from tpcache.cache.errors import (
    AllocatorError,
    CacheError,
    DuplicateRequest,
    IntegrityError,
    InvalidSlots,
    InvalidTokens,
    OutOfCapacity,
    UnknownHandle,
)
from tpcache.cache.events import AllBlocksCleared
from tpcache.cache.radix import Handle
from tpcache.cache.swa.allocator import PairedAllocator
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig, InvalidConfig, SwaHandle

R = lambda a, b: list(range(a, b + 1))  # noqa: E731


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be an int > 0"),
        ({"sliding_window": -8}, "sliding_window must be an int > 0"),
        ({"sliding_window": True}, "sliding_window must be an int > 0"),
        ({"sliding_window": 6}, "whole number of pages of 4"),
        ({"swa_capacity_tokens": 68}, "may not be larger than the full pool"),
        ({"swa_capacity_tokens": 2}, "swa_capacity_tokens must be an int >= page_size"),
        ({"capacity_tokens": 64.0}, "capacity_tokens must be an int"),
        ({"page_size": 0}, "page_size must be an int >= 1"),
        ({"policy": "random"}, "unknown policy"),
        ({"max_request_tokens": 0}, "max_request_tokens must be an int >= 1"),
    ],
)
def test_bad_config_is_a_typed_error(kwargs: dict[str, object], message: str) -> None:
    base = {"capacity_tokens": 64, "swa_capacity_tokens": 32, "sliding_window": 8, "page_size": 4}
    with pytest.raises(InvalidConfig, match=message):
        HybridConfig(**{**base, **kwargs})


def test_config_derived_values() -> None:
    cfg = HybridConfig(66, 34, 8, page_size=4, max_request_tokens=20)
    assert (cfg.num_pages, cfg.num_swa_pages, cfg.request_limit) == (16, 8, 20)
    assert HybridConfig(64, 33, 4, page_size=4).request_limit == 32  # the SWA pool bounds it


def _state():
    c = hybrid(64, 32, window=4)
    run(c, "a", R(1, 10))
    run(c, "b", [*R(1, 6), *R(20, 23)])
    c.admit("r", [*R(1, 6), 40, 41])
    return c


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.evict(-1), CacheError),
        (lambda c: c.evict(0, -1), CacheError),
        (lambda c: c.evict(True), CacheError),
        (lambda c: c.evict(1.5), CacheError),
        (lambda c: c.admit("r", [1, 2]), DuplicateRequest),
        (lambda c: c.admit("z", list(range(33))), InvalidTokens),  # over the SWA pool
        (lambda c: c.admit("z", [1, -2]), InvalidTokens),
        (lambda c: c.extend("r", 40), InvalidTokens),
        (lambda c: c.extend("r", -1), CacheError),
        (lambda c: c.insert([9, 9], [14, 15]), InvalidSlots),  # the request's row
        (lambda c: c.insert([9, 9], [0]), InvalidSlots),
        (lambda c: c.insert([9, 9], [64, 65]), InvalidSlots),
        (lambda c: c.free_slots([0]), AllocatorError),
        (lambda c: c.swa.slots([64]), InvalidSlots),
        (lambda c: c.alloc_slots(-1), CacheError),
        (lambda c: c.alloc_slots(40), OutOfCapacity),  # 33 SWA pages short
        (lambda c: c.lock(Handle(1, c.handles.owner)), UnknownHandle),
        (lambda c: c.lock(SwaHandle(999, c.handles.owner, 1)), UnknownHandle),
        (lambda c: c.finish("nope"), CacheError),
        (lambda c: c.cache_unfinished("r", [1, 2]), InvalidTokens),
    ],
)
def test_bad_input_raises_a_typed_error_and_changes_nothing(call, error) -> None:
    c = _state()
    before = snapshot(c)
    with pytest.raises(error):
        call(c)
    assert snapshot(c) == before
    c.check_integrity()


def test_insert_that_could_never_be_matched_is_refused() -> None:
    # Tombstone [1..6] (pages 0..5) keeps its full pages; an insert that gives those very
    # pages cannot revive it, and a 2-token tail after it could never end a match.
    c = hybrid(64, 64, window=4)
    run(c, "a", R(1, 10))
    run(c, "b", [*R(1, 6), *R(20, 23)])
    c.lock(c.match_prefix(R(1, 10)).handle)
    c.lock(c.match_prefix([*R(1, 6), *R(20, 23)]).handle)
    assert c.evict(0, 1).tombstoned == 1
    tail = c.alloc_slots(2)
    before = snapshot(c)
    with pytest.raises(InvalidSlots, match="cannot revive it"):
        c.insert([*R(1, 6), 30, 31], [*R(0, 5), *tail.tolist()])
    assert snapshot(c) == before
    with pytest.raises(InvalidSlots, match="no SWA page"):
        c.swa.slots([0])
    # Fresh slots revive it.
    fresh = c.alloc_slots(6)
    fresh_swa = c.swa.slots(fresh).tolist()
    assert c.insert([*R(1, 6), 30, 31], [*fresh.tolist(), *tail.tolist()]) == 6
    assert view(c)[0][1:3] == (R(0, 5), fresh_swa)  # full pages kept, SWA pages taken
    c.check_integrity()


def test_reset_drops_everything_and_announces_it() -> None:
    c = _state()
    h = c.match_prefix(R(1, 10)).handle
    c.take_events()
    c.reset()
    assert c.take_events() == [AllBlocksCleared()]
    assert view(c) == []
    with pytest.raises(UnknownHandle):
        c.lock(h)  # node ids keep growing across a reset
    assert c.admit("r", R(1, 4)).pages.tolist() == [0, 1, 2, 3]
    c.check_integrity()


# ---- planted corruption -------------------------------------------------------------------


def _tombstone_leaf(c) -> None:
    leaf = c.tree.walk()[-1]
    c.alloc.free_swa(leaf.pages, CACHED)
    leaf.tombstone = True
    c.tree.swa_order.forget(leaf)
    c.tree.swa_pages -= leaf.pages.size
    c.tree.tombstones += 1
    c.tree.tombstone_pages += leaf.pages.size


def _swa_lock_above_full_lock(c) -> None:
    c.tree.walk()[-1].swa_lock += 1


def _leaked_swa_slot(c) -> None:
    c.alloc.swa.take(1)


def _tombstone_keeps_swa(c) -> None:
    c.tree.walk()[0].tombstone = True


def _missing_from_swa_order(c) -> None:
    c.tree.swa_order.forget(c.tree.walk()[0])


def _lock_without_holder(c) -> None:
    leaf = c.tree.walk()[-1]
    c.tree.lock(leaf, c.tree.boundary(leaf))  # counters agree, but nobody holds it


def _mapped_swa_page_freed(c) -> None:
    # A cached node's SWA page is freed and another is taken: every count still adds up.
    c.alloc.swa.give(c.alloc.swa_of(c.tree.walk()[0].pages[:1]))
    c.alloc.swa.take(1)


PLANTS = {
    "tombstone leaf": (_tombstone_leaf, "tombstone .* is a leaf"),
    "SWA lock above full lock": (_swa_lock_above_full_lock, "SWA lock 1 above its full lock 0"),
    "leaked SWA slot": (_leaked_swa_slot, "SWA pool: free 17 .* != capacity 32"),
    "tombstone with SWA pages": (_tombstone_keeps_swa, "still maps SWA pages"),
    "missing from the SWA order": (_missing_from_swa_order, "not in the SWA eviction order"),
    "lock without a holder": (_lock_without_holder, "requests and handles hold"),
    "mapped SWA page freed": (_mapped_swa_page_freed, "both free and mapped"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_integrity_fails_on_planted_corruption(name: str) -> None:
    c = hybrid(64, 32, window=4)
    run(c, "a", R(1, 10))
    run(c, "b", [*R(1, 6), *R(20, 23)])
    c.check_integrity()
    plant, message = PLANTS[name]
    plant(c)
    with pytest.raises(IntegrityError, match=message):
        c.check_integrity()


def _busy_hybrid():
    """A tombstone ([1..6]) under two handle-locked branches, and a running request: every
    counter of the tree is nonzero."""
    c = hybrid(64, 64, window=4)
    run(c, "a", R(1, 10))
    run(c, "b", [*R(1, 6), *R(20, 23)])
    c.lock(c.match_prefix(R(1, 10)).handle)
    c.lock(c.match_prefix([*R(1, 6), *R(20, 23)]).handle)
    assert c.evict(0, 1).tombstoned == 1
    c.admit("r", R(30, 36))
    t = c.tree
    assert all((t.protected_pages, t.swa_protected, t.tombstones, t.tombstone_pages))
    c.check_integrity()
    return c


def _bump(field: str, by: int):
    return lambda c: setattr(c.tree, field, getattr(c.tree, field) + by)


# Each counter of the tree, moved alone. Conservation per pool sees the cached and SWA
# pages; only the tree's recount sees the others (protected, SWA protected, tombstones,
# their pages), so each of those plants fails when that recount is left out.
COUNTER_PLANTS = {
    "cached pages": (_bump("cached_pages", 1), "full pool: .* != capacity"),
    "SWA pages": (_bump("swa_pages", -1), "SWA pool: .* != capacity"),
    "protected pages": (_bump("protected_pages", 1), r"counters say \(14, 15, 8, 8, 1, 6\)"),
    "SWA protected pages": (_bump("swa_protected", -1), r"counters say \(14, 14, 8, 7, 1, 6\)"),
    "tombstones": (_bump("tombstones", 1), r"counters say \(14, 14, 8, 8, 2, 6\)"),
    "tombstone pages": (_bump("tombstone_pages", 1), r"counters say \(14, 14, 8, 8, 1, 7\)"),
}


@pytest.mark.parametrize("name", list(COUNTER_PLANTS))
def test_integrity_recounts_every_tree_counter(name: str) -> None:
    c = _busy_hybrid()
    plant, message = COUNTER_PLANTS[name]
    plant(c)
    with pytest.raises(IntegrityError, match=message):
        c.check_integrity()


# ---- paired allocator ---------------------------------------------------------------------


def test_paired_allocator_order_mapping_and_partial_frees() -> None:
    a = PairedAllocator(8, 4, page_size=2)
    p = a.alloc(3, HELD)
    assert (p.tolist(), a.swa_of(p).tolist()) == ([0, 1, 2], [0, 1, 2])
    a.retag(p, HELD, CACHED)
    a.free_swa(p[1:], CACHED)  # full pages 1, 2 keep their KV, SWA pages 1, 2 are free
    assert a.has_swa(p).tolist() == [True, False, False]
    assert (a.full.num_free, a.swa.num_free, a.num_free) == (5, 3, 3)
    q = a.alloc(3, HELD)  # SWA: 3, then the freed 1, 2 in order
    assert (q.tolist(), a.swa_of(q).tolist()) == ([3, 4, 5], [3, 1, 2])
    a.move_swa(q[1:], p[1:])  # a revive: 1, 2 take SWA pages 1, 2 back from 4, 5
    assert (a.swa_of(p).tolist(), a.has_swa(q).tolist()) == ([0, 1, 2], [True, False, False])
    a.free(q, HELD)  # frees full 3, 4, 5 and the one SWA page (3) still paired
    assert (a.full.num_free, a.swa.num_free) == (5, 1)
    a.check_integrity()
    with pytest.raises(OutOfCapacity):
        a.alloc(2)  # one SWA page free: nothing taken
    assert (a.full.num_free, a.swa.num_free) == (5, 1)
    with pytest.raises(AllocatorError, match="no SWA page"):
        a.swa_of(np.array([6]))
    with pytest.raises(AllocatorError):
        a.free_swa(np.array([6]), CACHED)  # a free page
    with pytest.raises(AllocatorError):
        a.free(p, HELD)  # cached, not held
    with pytest.raises(AllocatorError):
        PairedAllocator(4, 8, 1)
    a.check_integrity()
    a.swa.take(1)  # taken, but no full page maps to it
    with pytest.raises(IntegrityError, match="leaked or lost SWA page"):
        a.check_integrity()


def test_hybrid_admit_refuses_a_negative_token_behind_a_cached_prefix() -> None:
    c = HybridCache(HybridConfig(64, 64, 4, 4))
    c.admit("a", list(range(1, 13)))
    c.finish("a")
    digest = c.digest()
    with pytest.raises(InvalidTokens, match=">= 0"):
        c.admit("b", np.array([*range(1, 9), -1, 5], dtype=np.int32))
    assert c.digest() == digest
    c.check_integrity()


def test_hybrid_admit_result_cannot_write_into_the_request_row() -> None:
    c = HybridCache(HybridConfig(64, 64, 4, 4))
    got = c.admit("a", list(range(1, 11)))
    with pytest.raises(ValueError, match="read-only"):
        got.pages[:] = 0
    c.finish("a")
    c.check_integrity()
