"""PageAllocator: the defined allocation order, owner tags, batched frees and misuse."""

from __future__ import annotations

import numpy as np
import pytest

from tpcache.cache.allocator import CACHED, FREE, HELD, PageAllocator, log_free
from tpcache.cache.errors import AllocatorError, IntegrityError, OutOfCapacity


def _pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def _fifo(a: PageAllocator) -> list[int]:
    return a.free_order()


def test_alloc_takes_lowest_first_then_frees_in_fifo_of_sorted_groups() -> None:
    a = PageAllocator(8, 4)
    assert a.alloc(3).tolist() == [0, 1, 2]
    assert a.alloc(2).tolist() == [3, 4]
    a.free(_pages(4, 0))  # one group, appended sorted
    a.free(_pages(2))
    assert _fifo(a) == [5, 6, 7, 0, 4, 2]
    assert a.alloc(4).tolist() == [5, 6, 7, 0]
    assert a.alloc(2).tolist() == [4, 2]
    assert a.num_free == 0
    a.check_integrity()


def test_fifo_wraps_around_the_ring() -> None:
    a = PageAllocator(5, 1)
    first = a.alloc(4)
    a.free(first[::-1].copy())  # tail wraps: [4, 0, 1, 2, 3]
    assert _fifo(a) == [4, 0, 1, 2, 3]
    assert a.alloc(5).tolist() == [4, 0, 1, 2, 3]
    a.free(_pages(3, 1))
    a.free(_pages(0, 4, 2))
    assert _fifo(a) == [1, 3, 0, 2, 4]
    a.check_integrity()


def test_counts_tags_and_fingerprint_follow_each_change() -> None:
    a = PageAllocator(6, 2)
    p = a.alloc(4)
    assert (a.count(FREE), a.count(HELD), a.count(CACHED)) == (2, 4, 0)
    a.retag(p[:2], HELD, CACHED)
    assert (a.count(FREE), a.count(HELD), a.count(CACHED)) == (2, 2, 2)
    assert a.tags_of(p).tolist() == [CACHED, CACHED, HELD, HELD]
    # counts per tag (free, held, cached, lent), FIFO head, log of free groups (none yet)
    assert a.fingerprint() == (2, 2, 2, 0, 4, 0)
    a.free(p[:2], CACHED)
    assert a.fingerprint()[:5] == (4, 2, 0, 0, 4)
    assert a.fingerprint()[5] == log_free(0, p[:2])
    a.check_integrity()


def test_fingerprint_tells_apart_different_frees_of_the_same_size() -> None:
    # Same counts, same head: only which pages went back differs (what the log is for).
    a, b = PageAllocator(8, 1), PageAllocator(8, 1)
    pa, pb = a.alloc(4), b.alloc(4)
    a.free(pa[:2])
    b.free(pb[2:])
    assert a.fingerprint()[:5] == b.fingerprint()[:5]
    assert a.fingerprint() != b.fingerprint()
    # And the order of the groups counts: the FIFO, and so later allocations, differ.
    c, d = PageAllocator(8, 1), PageAllocator(8, 1)
    pc, pd = c.alloc(4), d.alloc(4)
    c.free(pc[:2])
    c.free(pc[2:])
    d.free(pd[2:])
    d.free(pd[:2])
    assert c.fingerprint() != d.fingerprint()


def test_out_of_capacity_takes_nothing() -> None:
    a = PageAllocator(4, 1)
    a.alloc(3)
    before = (a.fingerprint(), _fifo(a))
    with pytest.raises(OutOfCapacity, match="asked for 2 pages, 1 free"):
        a.alloc(2)
    assert (a.fingerprint(), _fifo(a)) == before
    with pytest.raises(AllocatorError):
        a.alloc(-1)


@pytest.mark.parametrize(
    ("pages", "owner", "message"),
    [
        (_pages(1, 1), HELD, "given twice"),
        (_pages(0, 9), HELD, r"in \[0, 8\)"),
        (_pages(-1), HELD, r"in \[0, 8\)"),
        (_pages(5), HELD, "page 5 is free, expected held"),  # never allocated: double free
        (_pages(0, 1), CACHED, "page 0 is held, expected cached"),
    ],
)
def test_bad_frees_raise_and_change_nothing(pages: np.ndarray, owner: int, message: str) -> None:
    a = PageAllocator(8, 1)
    a.alloc(3)
    before = (a.fingerprint(), _fifo(a))
    with pytest.raises(AllocatorError, match=message):
        a.free(pages, owner)
    assert (a.fingerprint(), _fifo(a)) == before
    a.check_integrity()


def test_double_free_is_caught() -> None:
    a = PageAllocator(4, 1)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(AllocatorError, match="is free, expected held"):
        a.free(p)


def test_retag_misuse() -> None:
    a = PageAllocator(4, 1)
    p = a.alloc(2)
    with pytest.raises(AllocatorError):
        a.retag(p, HELD, FREE)
    with pytest.raises(AllocatorError, match="expected cached"):
        a.retag(p, CACHED, HELD)
    a.check_integrity()


def test_reset_restores_the_initial_order() -> None:
    a = PageAllocator(4, 1)
    a.free(a.alloc(4)[::-1].copy())
    a.alloc(1)
    a.reset()
    assert _fifo(a) == [0, 1, 2, 3]
    assert a.fingerprint() == PageAllocator(4, 1).fingerprint()


def test_integrity_catches_corrupted_fifo_and_counters() -> None:
    a = PageAllocator(6, 1)
    a.alloc(2)
    a.check_integrity()
    a._fifo[a._head] = 0  # a held page queued as free
    with pytest.raises(IntegrityError, match="in the free FIFO but not free"):
        a.check_integrity()
    a = PageAllocator(6, 1)
    a.alloc(2)
    a._fifo[a._head + 1] = a._fifo[a._head]  # a free page queued twice
    with pytest.raises(IntegrityError, match="distinct"):
        a.check_integrity()
    a = PageAllocator(6, 1)
    a._counts[FREE] -= 1
    a._counts[HELD] += 1
    with pytest.raises(IntegrityError, match="tag counts"):
        a.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_recycle_is_free_then_alloc(seed: int) -> None:
    """``recycle`` hands out the pages, and leaves the FIFO, tags and fingerprint, that a
    free followed by an alloc does (the ring wrapping, with and without free pages)."""
    print("seed", seed)
    rng = np.random.default_rng(seed)
    a, b = PageAllocator(12, 1), PageAllocator(12, 1)
    every = np.arange(12)
    recycled = 0
    for _ in range(60):
        k = int(rng.integers(0, a.num_free + 1))
        assert a.alloc(k, CACHED).tolist() == b.alloc(k, CACHED).tolist()
        cached = np.flatnonzero(a.tags_of(every) == CACHED)
        if cached.size == 0:
            continue
        group = rng.permutation(cached)[: int(rng.integers(1, cached.size + 1))]
        n = int(rng.integers(0, group.size + a.num_free + 1))
        recycled += a.num_free == 0 and group.size > n
        got = a.recycle(group.copy(), CACHED, n, CACHED)
        b.free(group.copy(), CACHED, checked=False)
        assert got.tolist() == b.alloc(n, CACHED).tolist()
        assert a.fingerprint() == b.fingerprint()
        assert a.tags_of(every).tolist() == b.tags_of(every).tolist()
        a.check_integrity()
    assert recycled > 0  # the fused path (nothing else free) ran
