"""The request lifecycle, exact state: admit, extend, cache_unfinished, finish, abort, reset.

Rows (the request-to-slot table), lock counts, sizes and the allocator's order are
asserted exactly, at page size 1 and 4.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import snapshot, tree_nodes

from tpcache.cache.errors import OutOfCapacity
from tpcache.cache.radix import CacheConfig, RadixCache


def _cache(capacity: int, page_size: int = 1, policy: str = "lru") -> RadixCache:
    return RadixCache(CacheConfig(capacity, page_size, policy, record_events=True))


def _sizes(cache: RadixCache) -> tuple[int, int, int, int]:
    s = cache.sizes()
    return s.free, s.evictable, s.protected, s.held


def _row(cache: RadixCache, rid: object) -> tuple[list[int], int, int]:
    req = cache.reqs.get(rid)
    return req.pages.tolist(), req.num_tokens, req.cached_pages


def test_admit_extend_finish_page1() -> None:
    c = _cache(16)
    got = c.admit("a", [1, 2, 3, 4])
    assert (got.prefix_len, got.slots.tolist(), got.num_tokens) == (0, [0, 1, 2, 3], 4)
    assert _sizes(c) == (12, 0, 0, 4)
    assert c.extend("a", 2).tolist() == [4, 5]
    assert c.extend("a", 0).tolist() == []
    assert _row(c, "a") == ([0, 1, 2, 3, 4, 5], 6, 0)
    assert c.finish("a", [5, 6]) == 6
    assert "a" not in c.reqs
    assert tree_nodes(c) == [([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], 0)]
    assert _sizes(c) == (10, 6, 0, 0)

    got = c.admit("b", [1, 2, 3, 4, 5, 6, 7])
    assert (got.prefix_len, got.slots.tolist()) == (6, [0, 1, 2, 3, 4, 5, 6])
    assert _sizes(c) == (9, 0, 6, 1)
    assert c.finish("b") == 7
    assert tree_nodes(c) == [([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], 0), ([7], [6], 0)]
    assert _sizes(c) == (9, 7, 0, 0)
    c.check_integrity()


def test_a_fully_cached_prompt_reuses_all_but_its_last_token() -> None:
    c = _cache(16)
    c.admit("a", [1, 2, 3])
    c.finish("a")
    got = c.admit("c", [1, 2, 3])
    assert (got.prefix_len, got.slots.tolist()) == (2, [0, 1, 3])  # split at 2
    assert tree_nodes(c) == [([1, 2], [0, 1], 1), ([3], [2], 0)]
    assert _sizes(c) == (12, 1, 2, 1)
    assert c.finish("c") == 3  # slot 3 duplicates slot 2: freed
    assert _sizes(c) == (13, 3, 0, 0)
    assert c.alloc_slots(13).tolist()[-1] == 3
    c.check_integrity()


def test_admit_extend_finish_page4() -> None:
    c = _cache(64, 4)
    p = list(range(100, 114))  # 14 tokens
    got = c.admit("a", p[:10])
    assert (got.prefix_len, got.pages.tolist(), got.slots.tolist()) == (
        0,
        [0, 1, 2],
        list(range(10)),
    )
    assert _sizes(c) == (52, 0, 0, 12)
    assert c.extend("a", 1).tolist() == [10]  # still in page 2
    assert c.extend("a", 2).tolist() == [11, 12]  # page 3 starts at slot 12
    assert _row(c, "a") == ([0, 1, 2, 3], 13, 0)
    assert c.finish("a", [113, 114, 115]) == 12  # 13 tokens have KV: 3 whole pages
    assert tree_nodes(c) == [([*p[:10], 113, 114], [0, 1, 2], 0)]
    assert _sizes(c) == (52, 12, 0, 0)  # page 3 (the partial tail) is free again

    got = c.admit("b", [*p[:10], 113, 114, 7, 7])  # 14 tokens: reuse (14 - 1) // 4 = 3 pages
    assert (got.prefix_len, got.pages.tolist()) == (12, [0, 1, 2, 4])
    assert got.slots.tolist() == [*range(12), 16, 17]
    assert _sizes(c) == (48, 0, 12, 4)
    c.abort("b")
    assert _sizes(c) == (52, 12, 0, 0)
    c.check_integrity()


def test_prompt_shorter_than_a_page_reuses_nothing() -> None:
    c = _cache(32, 4)
    c.admit("a", [1, 2, 3, 4, 5])
    c.finish("a")
    got = c.admit("b", [1, 2, 3, 4])  # (4 - 1) // 4 = 0 pages may be reused
    assert (got.prefix_len, got.pages.tolist()) == (0, [2])
    got = c.admit("c", [1, 2, 3])
    assert (got.prefix_len, got.slots.tolist()) == (0, [12, 13, 14])
    assert c.finish("c") == 0  # nothing whole to cache: its page is freed
    assert c.finish("b") == 4  # page 2 duplicates page 0
    assert _sizes(c) == (28, 4, 0, 0)
    c.check_integrity()


def test_cache_unfinished_chunks_move_the_lock_page4() -> None:
    c = _cache(64, 4)
    p = list(range(1, 13))
    assert c.admit("a", p[:6]).pages.tolist() == [0, 1]
    assert c.cache_unfinished("a", p[:6]) == 4
    assert _row(c, "a") == ([0, 1], 6, 1)
    assert tree_nodes(c) == [(p[:4], [0], 1)]
    assert _sizes(c) == (56, 0, 4, 4)
    assert c.extend("a", 6).tolist() == [6, 7, 8, 9, 10, 11]
    assert c.cache_unfinished("a", p) == 12
    assert tree_nodes(c) == [(p[:4], [0], 1), (p[4:], [1, 2], 1)]
    assert _row(c, "a") == ([0, 1, 2], 12, 3)
    assert _sizes(c) == (52, 0, 12, 0)
    assert c.finish("a") == 12
    assert tree_nodes(c) == [(p[:4], [0], 0), (p[4:], [1, 2], 0)]
    assert _sizes(c) == (52, 12, 0, 0)
    c.check_integrity()


def test_cache_unfinished_rewrites_the_row_to_the_trees_pages() -> None:
    # Two requests prefill the same prompt at once; the second to cache its chunk finds
    # the first's pages in the tree: its own are duplicates, freed, and its row and lock
    # move to the tree's.
    c = _cache(64, 4)
    p = list(range(1, 11))
    assert c.admit("a", p).pages.tolist() == [0, 1, 2]
    assert c.admit("b", p).pages.tolist() == [3, 4, 5]
    assert c.cache_unfinished("a", p) == 8
    assert c.cache_unfinished("b", p) == 8
    assert _row(c, "a") == ([0, 1, 2], 10, 2)
    assert _row(c, "b") == ([0, 1, 5], 10, 2)
    assert tree_nodes(c) == [(p[:8], [0, 1], 2)]
    assert _sizes(c) == (48, 0, 8, 8)
    assert c.alloc_slots(48).tolist()[-8:] == list(range(12, 20))  # pages 3, 4 came back
    c.free_slots(list(range(24, 64)) + list(range(12, 20)))
    assert c.finish("b", [11, 12]) == 8  # 12 tokens known but only 10 have KV: 2 pages
    assert c.finish("a") == 8
    assert tree_nodes(c) == [(p[:8], [0, 1], 0)]
    assert _sizes(c) == (56, 8, 0, 0)
    c.check_integrity()


def test_cache_unfinished_after_a_partial_match_splits_and_locks_the_new_end() -> None:
    c = _cache(32, 1)
    c.admit("a", [1, 2, 3, 4, 5])
    c.finish("a")
    got = c.admit("b", [1, 2, 9])
    assert got.prefix_len == 2
    assert tree_nodes(c) == [([1, 2], [0, 1], 1), ([3, 4, 5], [2, 3, 4], 0)]
    assert c.cache_unfinished("b", [1, 2, 9]) == 3
    assert tree_nodes(c) == [([1, 2], [0, 1], 1), ([3, 4, 5], [2, 3, 4], 0), ([9], [5], 1)]
    assert _row(c, "b") == ([0, 1, 5], 3, 3)
    assert c.extend("b", 1).tolist() == [6]
    assert c.finish("b", [9, 8]) == 4  # [1, 2, 9, 9] have KV, the 8 has none
    assert tree_nodes(c)[2:] == [([9], [5], 0), ([9], [6], 0)]
    c.check_integrity()


def test_abort_frees_own_pages_and_unlocks() -> None:
    c = _cache(16, 1)
    c.admit("a", [1, 2, 3])
    c.finish("a")
    c.admit("b", [1, 2, 3, 4, 5])
    c.extend("b", 2)
    assert _sizes(c) == (9, 0, 3, 4)
    c.abort("b")
    assert _sizes(c) == (13, 3, 0, 0)
    assert tree_nodes(c) == [([1, 2, 3], [0, 1, 2], 0)]
    # cache_unfinished's pages stay cached after an abort
    c.admit("c", [7, 8])
    c.cache_unfinished("c", [7, 8])
    c.extend("c", 1)
    c.abort("c")
    assert tree_nodes(c) == [([1, 2, 3], [0, 1, 2], 0), ([7, 8], [7, 8], 0)]
    assert _sizes(c) == (11, 5, 0, 0)
    c.check_integrity()


def test_admit_evicts_the_shortfall_and_never_its_own_match() -> None:
    c = _cache(6, 1)
    c.admit("a", [1, 2, 3, 4])
    c.finish("a")
    got = c.admit("x", [1, 2, 9, 9, 9, 9])  # needs 4, 2 free, [3, 4] evictable
    assert (got.prefix_len, got.slots.tolist()) == (2, [0, 1, 4, 5, 2, 3])
    assert tree_nodes(c) == [([1, 2], [0, 1], 1)]
    assert _sizes(c) == (0, 0, 2, 4)
    c.check_integrity()


def test_out_of_capacity_on_admit_changes_nothing_even_with_a_partial_match() -> None:
    c = _cache(8, 1)
    c.admit("run", [50, 51])
    c.admit("a", [1, 2, 3, 4, 5, 6])
    c.finish("a")
    assert _sizes(c) == (0, 6, 0, 2)
    before = (
        snapshot(c),
        tree_nodes(c),
        (c.alloc.free_order(), c.alloc.fingerprint()),
        c.tree.tick,
    )
    # needs 4 pages: 0 free; the 6 cached are evictable, but 4 of them are its own match
    with pytest.raises(OutOfCapacity, match="need 4 pages of 1: 0 free \\+ 2 evictable"):
        c.admit("z", [1, 2, 3, 4, 8, 8, 8, 8])
    with pytest.raises(OutOfCapacity, match="eviction not allowed"):
        c.admit("z", [1, 2, 3, 4, 8], evict=False)
    assert (
        snapshot(c),
        tree_nodes(c),
        (c.alloc.free_order(), c.alloc.fingerprint()),
        c.tree.tick,
    ) == (
        before[0],
        before[1],
        before[2],
        before[3],
    )
    assert "z" not in c.reqs
    c.check_integrity()


def test_extend_evicts_or_fails_cleanly() -> None:
    c = _cache(12, 4)  # 3 pages
    c.admit("a", [1, 2, 3, 4, 5])
    c.finish("a")  # caches page 0, frees page 1
    assert c.admit("b", [9, 9]).pages.tolist() == [2]
    assert c.admit("c", [7, 7]).pages.tolist() == [1]
    assert _sizes(c) == (0, 4, 0, 8)
    before = snapshot(c)
    with pytest.raises(OutOfCapacity, match="eviction not allowed"):
        c.extend("b", 3, evict=False)
    with pytest.raises(OutOfCapacity, match="need 2 pages of 4: 0 free \\+ 1 evictable"):
        c.extend("b", 7)  # 9 tokens would need 3 pages
    assert snapshot(c) == before
    assert c.extend("b", 3).tolist() == [10, 11, 0]  # evicts page 0 and takes it
    assert _sizes(c) == (0, 0, 0, 12)
    c.check_integrity()


def test_reset_clears_everything_and_restarts_the_order() -> None:
    c = _cache(16, 1)
    c.admit("a", [1, 2, 3])
    c.finish("a")
    c.admit("b", [1, 2, 3, 4])
    c.alloc_slots(2)
    c.take_events()
    c.reset()
    assert _sizes(c) == (16, 0, 0, 0)
    assert len(c.reqs) == 0 and tree_nodes(c) == []
    assert c.digest() == RadixCache(CacheConfig(16, 1, record_events=True)).digest()
    from tpcache.cache.events import AllBlocksCleared

    assert c.take_events() == [AllBlocksCleared()]
    assert c.admit("a", [1, 2, 3]).slots.tolist() == [0, 1, 2]
    c.check_integrity()


def test_request_ids_may_be_ints_or_strings_and_rows_keep_admission_order() -> None:
    c = _cache(16, 1)
    c.admit(3, [1])
    c.admit("x", [2])
    c.admit(1, [3])
    assert c.reqs.ids() == [3, "x", 1]
    assert c.extend(3, 1).tolist() == [3]
    c.finish("x")
    assert c.reqs.ids() == [3, 1]


def test_admit_keeps_its_own_copy_of_the_prompt() -> None:
    # Regression: admit kept the caller's int32 array (no copy), so a caller that reused
    # its buffer changed the request's tokens, and finish cached the wrong ones.
    c = _cache(16, 1)
    buf = np.array([1, 2, 3, 4], dtype=np.int32)
    c.admit("a", buf)
    buf[:] = 7
    assert c.finish("a") == 4
    assert tree_nodes(c) == [([1, 2, 3, 4], [0, 1, 2, 3], 0)]
    # the same for the tokens cache_unfinished is given
    c.admit("b", [5])
    c.extend("b", 1)
    buf = np.array([5, 6], dtype=np.int32)
    c.cache_unfinished("b", buf)
    buf[:] = 0
    c.extend("b", 1)
    assert c.finish("b", [8]) == 3
    assert tree_nodes(c)[1:] == [([5, 6], [4, 5], 0), ([8], [6], 0)]
    c.check_integrity()


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_extend_returns_the_slots_of_exactly_its_tokens_one_or_many(page_size: int) -> None:
    # Decode steps (a few tokens) take a Python path, longer extends a vectorised one:
    # both must give the row's slots of exactly the new tokens, across page boundaries.
    seed = 77 + page_size
    print(f"seed={seed}")
    rng = random.Random(seed)
    c = RadixCache(CacheConfig(4096 * page_size, page_size))
    c.admit("r", [rng.randrange(1, 999) for _ in range(rng.randrange(1, 40))])
    held = c.reqs.get("r").num_tokens
    for _ in range(60):
        n = rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 16, 33])
        got = c.extend("r", n)
        req = c.reqs.get("r")
        everything = [p * page_size + o for p in req.pages.tolist() for o in range(page_size)]
        assert got.dtype == np.int64 and got.tolist() == everything[held : held + n]
        held += n
    c.check_integrity()
