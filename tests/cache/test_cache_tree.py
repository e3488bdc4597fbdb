"""Tree-level ops of RadixCache, exact state: match, insert, splits, locks, evict, handles.

Page size 1 and 4. Slot ids and the allocator's order are asserted exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import snapshot, tree_nodes

from tpcache.cache.allocator import LENT
from tpcache.cache.errors import LockError, UnknownHandle
from tpcache.cache.policy.order import EvictionOrder
from tpcache.cache.radix import CacheConfig, CacheSizes, EvictResult, RadixCache


def _cache(capacity: int, page_size: int = 1, policy: str = "lru") -> RadixCache:
    return RadixCache(CacheConfig(capacity, page_size, policy, record_events=True))


def _put(cache: RadixCache, tokens: list[int]) -> int:
    return cache.insert(tokens, cache.alloc_slots(len(tokens)))


def _sizes(cache: RadixCache) -> tuple[int, int, int, int]:
    s = cache.sizes()
    return s.free, s.evictable, s.protected, s.held


# ---- page size 1 -------------------------------------------------------------------------


def test_insert_match_split_and_duplicate_slots_page1() -> None:
    c = _cache(16)
    s1 = c.alloc_slots(4)
    assert s1.tolist() == [0, 1, 2, 3]
    assert _sizes(c) == (12, 0, 0, 4)
    assert c.insert([1, 2, 3, 4], s1) == 0
    assert c.sizes() == CacheSizes(capacity=16, free=12, evictable=4, protected=0, held=0)
    assert tree_nodes(c) == [([1, 2, 3, 4], [0, 1, 2, 3], 0)]

    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.prefix_len, m.slots.tolist()) == (4, [0, 1, 2, 3])
    assert tree_nodes(c) == [([1, 2, 3, 4], [0, 1, 2, 3], 0)]  # no split at a node's end

    m = c.match_prefix([1, 2, 9])
    assert (m.prefix_len, m.slots.tolist()) == (2, [0, 1])
    assert tree_nodes(c) == [([1, 2], [0, 1], 0), ([3, 4], [2, 3], 0)]
    assert _sizes(c) == (12, 4, 0, 0)  # a split changes no ownership

    s2 = c.alloc_slots(4)
    assert s2.tolist() == [4, 5, 6, 7]
    assert c.insert([1, 2, 7, 8], s2) == 2  # slots 4, 5 are duplicates of 0, 1: freed
    assert tree_nodes(c) == [([1, 2], [0, 1], 0), ([3, 4], [2, 3], 0), ([7, 8], [6, 7], 0)]
    assert _sizes(c) == (10, 6, 0, 0)
    # Freed duplicates go to the end of the free FIFO, after the never-used pages.
    assert c.alloc_slots(10).tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 4, 5]
    c.check_integrity()


def test_match_misses_and_empty_match_page1() -> None:
    c = _cache(8)
    _put(c, [5, 6, 7])
    m = c.match_prefix([6, 5])
    assert (m.prefix_len, m.slots.tolist(), m.pages.dtype) == (0, [], np.int64)
    assert m.handle.node_id == c.tree.root.id == 0  # the root
    c.lock(m.handle)  # locking the empty prefix protects nothing
    assert _sizes(c) == (5, 3, 0, 0)
    c.unlock(m.handle)
    m = c.match_prefix([5, 6, 7, 8, 9])
    assert (m.prefix_len, m.slots.tolist()) == (3, [0, 1, 2])


def test_insert_of_a_cached_prefix_frees_every_duplicate_and_returns_its_length() -> None:
    c = _cache(8)
    _put(c, [1, 2, 3])
    s = c.alloc_slots(2)
    assert s.tolist() == [3, 4]
    assert c.insert([1, 2], s) == 2
    # The insert ends inside a node, so it splits there (its end is a node to lock).
    assert tree_nodes(c) == [([1, 2], [0, 1], 0), ([3], [2], 0)]
    assert _sizes(c) == (5, 3, 0, 0)
    # Giving the tree's own slots for the cached part is not a duplicate.
    s = c.alloc_slots(1)
    assert s.tolist() == [5]
    assert c.insert([1, 2, 3, 4], [0, 1, 2, 5]) == 3
    assert tree_nodes(c) == [([1, 2], [0, 1], 0), ([3], [2], 0), ([4], [5], 0)]
    assert c.alloc.num_free == 4
    c.check_integrity()


def test_lock_unlock_sizes_nest_and_double_unlock_fails() -> None:
    c = _cache(16)
    _put(c, [1, 2, 3, 4])
    _put(c, [1, 2, 5])  # splits: [1,2] -> {[3,4], [5]}
    leaf = c.match_prefix([1, 2, 3, 4]).handle
    upper = c.match_prefix([1, 2]).handle
    assert _sizes(c) == (11, 5, 0, 0)
    c.lock(leaf)
    assert _sizes(c) == (11, 1, 4, 0)  # the leaf and its ancestor [1, 2]
    c.lock(upper)
    c.lock(leaf)
    assert _sizes(c) == (11, 1, 4, 0)
    assert [n[2] for n in tree_nodes(c)] == [3, 2, 0]
    c.unlock(leaf)
    c.unlock(leaf)
    assert _sizes(c) == (11, 3, 2, 0)
    c.unlock(upper)
    assert _sizes(c) == (11, 5, 0, 0)
    before = snapshot(c)
    with pytest.raises(LockError, match="not locked"):
        c.unlock(upper)
    with pytest.raises(LockError):
        c.unlock(leaf)
    assert snapshot(c) == before
    assert [n[2] for n in tree_nodes(c)] == [0, 0, 0]
    c.check_integrity()


def test_a_handle_survives_a_split_and_still_ends_at_the_same_point() -> None:
    c = _cache(16)
    _put(c, [1, 2, 3, 4])
    h = c.match_prefix([1, 2, 3, 4]).handle
    c.match_prefix([1, 2, 9])  # splits the node h names
    c.lock(h)
    assert _sizes(c) == (12, 0, 4, 0)
    c.unlock(h)


def test_evict_returns_tokens_and_nodes_and_a_parent_goes_in_the_same_call() -> None:
    c = _cache(16)
    _put(c, [1, 2, 3, 4])
    _put(c, [1, 2, 5])  # [1,2] -> {[3,4], [5]}
    c.take_events()
    # lru: [3,4] (older) goes first, then [5]; then [1,2] has become a leaf and goes too.
    assert c.evict(3) == EvictResult(num_tokens=3, num_nodes=2)
    assert tree_nodes(c) == [([1, 2], [0, 1], 0)]
    assert c.evict(1) == EvictResult(num_tokens=2, num_nodes=1)
    assert tree_nodes(c) == []
    assert c.evict(5) == EvictResult(0, 0)
    assert _sizes(c) == (16, 0, 0, 0)
    # Free FIFO: never-used pages, the duplicates 4, 5, then one sorted group per evict.
    assert c.alloc_slots(16).tolist() == [*range(7, 16), 4, 5, 2, 3, 6, 0, 1]
    c.check_integrity()


def test_evict_frees_whole_chain_in_one_call_and_groups_frees() -> None:
    c = _cache(8)
    _put(c, [1, 2])
    _put(c, [1, 2, 3])  # slots 2, 3, 4: 2 and 3 are duplicates
    assert tree_nodes(c) == [([1, 2], [0, 1], 0), ([3], [4], 0)]
    assert c.evict(8) == EvictResult(num_tokens=3, num_nodes=2)
    # free FIFO: 5, 6, 7 (never used), 2, 3 (duplicates), then the eviction group 0, 1, 4
    assert c.alloc_slots(8).tolist() == [5, 6, 7, 2, 3, 0, 1, 4]


def test_evict_skips_locked_paths_and_counts_whole_nodes() -> None:
    c = _cache(16)
    _put(c, [1, 2, 3, 4])
    _put(c, [9, 8])
    h = c.match_prefix([1, 2, 3]).handle  # splits [1,2,3] | [4]
    c.lock(h)
    assert c.evict(16) == EvictResult(num_tokens=3, num_nodes=2)  # [4] and [9,8]
    assert tree_nodes(c) == [([1, 2, 3], [0, 1, 2], 1)]
    assert _sizes(c) == (13, 0, 3, 0)
    c.unlock(h)
    assert c.evict(1) == EvictResult(3, 1)


def test_stale_handles_are_unknown() -> None:
    c = _cache(8)
    _put(c, [1, 2])
    h = c.match_prefix([1, 2]).handle
    c.evict(2)
    before = snapshot(c)
    with pytest.raises(UnknownHandle, match="evicted or foreign"):
        c.lock(h)
    with pytest.raises(UnknownHandle):
        c.unlock(h)
    with pytest.raises(UnknownHandle, match="not a handle"):
        c.lock(h.node_id)  # type: ignore[arg-type]
    assert snapshot(c) == before


def test_a_handle_from_before_reset_names_nothing_after_it() -> None:
    c = _cache(8)
    _put(c, [1, 2])
    h = c.match_prefix([1, 2]).handle
    c.reset()
    _put(c, [3, 4])  # a new node; it must not take the old handle's id
    before = snapshot(c)
    with pytest.raises(UnknownHandle):
        c.lock(h)
    assert snapshot(c) == before


# ---- page size 4 -------------------------------------------------------------------------


def test_pages_only_whole_pages_are_cached_matched_and_split() -> None:
    c = _cache(32, 4)
    toks = list(range(100, 110))  # 2 whole pages + 2 tokens
    s = c.alloc_slots(10)
    assert s.tolist() == list(range(10))
    assert c.insert(toks, s) == 0
    assert tree_nodes(c) == [(toks[:8], [0, 1], 0)]
    # The partial page (slots 8, 9 of page 2) stays the caller's.
    assert _sizes(c) == (20, 8, 0, 4)
    assert c.alloc.tags_of(np.array([2])).tolist() == [LENT]
    c.free_slots([8, 9, 10, 11])
    assert _sizes(c) == (24, 8, 0, 0)

    m = c.match_prefix(toks[:7])  # 7 tokens: one whole page
    assert (m.prefix_len, m.pages.tolist(), m.slots.tolist()) == (4, [0], [0, 1, 2, 3])
    assert tree_nodes(c) == [(toks[:4], [0], 0), (toks[4:8], [1], 0)]

    m = c.match_prefix([*toks[:6], 0, 0, 0])  # diverges inside page 1: one page
    assert m.prefix_len == 4
    m = c.match_prefix(toks)
    assert (m.prefix_len, m.slots.tolist()) == (8, list(range(8)))


def test_pages_insert_diverging_inside_a_page_splits_at_the_page_before() -> None:
    c = _cache(32, 4)
    a = list(range(1, 13))  # 3 pages
    _put(c, a)
    b = [*a[:6], 99, 98]  # shares page 0 and half of page 1
    s = c.alloc_slots(8)
    assert s.tolist() == list(range(12, 20))  # pages 3, 4
    assert c.insert(b, s) == 4
    assert tree_nodes(c) == [(a[:4], [0], 0), (a[4:], [1, 2], 0), (b[4:], [4], 0)]
    assert _sizes(c) == (16, 16, 0, 0)  # page 3 was a duplicate of page 0: freed
    assert c.alloc_slots(4).tolist() == [20, 21, 22, 23]  # page 5: then 6, 7, then 3
    assert c.alloc_slots(12).tolist()[-4:] == [12, 13, 14, 15]
    c.check_integrity()


def test_pages_lock_and_evict_count_tokens_in_pages() -> None:
    c = _cache(32, 4)
    _put(c, list(range(1, 13)))
    _put(c, [*range(1, 5), 50, 51, 52, 53])
    h = c.match_prefix(list(range(1, 13))).handle
    c.lock(h)
    assert _sizes(c) == (16, 4, 12, 0)
    assert c.evict(1) == EvictResult(num_tokens=4, num_nodes=1)
    assert c.evict(1) == EvictResult(0, 0)
    c.unlock(h)
    assert c.evict(5) == EvictResult(num_tokens=8, num_nodes=1)  # the [5..12] leaf
    assert c.evict(5) == EvictResult(num_tokens=4, num_nodes=1)
    assert _sizes(c) == (32, 0, 0, 0)
    c.check_integrity()


def test_evict_keeps_going_when_the_queue_is_rebuilt_mid_call(monkeypatch) -> None:
    # Regression: evict() popped from a local alias of the heap; when a parent's push
    # made the queue rebuild itself, the parent (and every other live entry) sat in the
    # new heap, so the call stopped early although enough was evictable. Here the queue
    # rebuilds its heap after every push, so a rebuild comes between every two pops.
    c = _cache(8, 1, "mru")
    for n in (1, 2, 3):
        _put(c, list(range(1, n + 1)))  # a chain [1] -> [2] -> [3]
    for _ in range(1100):
        c.match_prefix([1, 2, 3])  # each match queues a new entry for the leaf
    push = EvictionOrder.push
    rebuilds = []

    def push_and_rebuild(order: EvictionOrder, node: object) -> None:
        push(order, node)
        order.compact()
        rebuilds.append(node)

    monkeypatch.setattr(EvictionOrder, "push", push_and_rebuild)
    assert c.evict(3) == EvictResult(num_tokens=3, num_nodes=3)
    assert len(rebuilds) == 2  # [2] and [1] joined the queue mid-call
    assert tree_nodes(c) == []
    c.check_integrity()


def test_a_handle_cannot_unlock_a_lock_a_running_request_holds() -> None:
    # Regression: lock counts were anonymous, so unlock() of a handle that was never
    # locked (or a second unlock) took the lock of a running request on the same node;
    # its prefix then became evictable while the request still used it.
    c = _cache(8)
    c.admit("r", [1, 2, 3])
    c.finish("r")
    c.admit("run", [1, 2, 3, 4])
    h = c.match_prefix([1, 2, 3]).handle
    with pytest.raises(LockError, match="not locked"):
        c.unlock(h)
    c.lock(h)
    c.unlock(h)
    with pytest.raises(LockError, match="not locked"):
        c.unlock(h)
    assert _sizes(c) == (4, 0, 3, 1)
    assert c.evict(8) == EvictResult(0, 0)
    c.check_integrity()


@pytest.mark.parametrize("pieces", [1, 3])
def test_results_never_share_the_trees_arrays(pieces: int) -> None:
    # A caller that writes into what match_prefix or admit returned must not change
    # the cache (one node on the path takes a different branch than several).
    c = RadixCache(CacheConfig(256, 4))
    prompt = list(range(1, 49))
    for i in range(1, pieces + 1):
        c.admit(i, prompt[: 48 * i // pieces])
        c.finish(i)
    digest = c.digest()
    m = c.match_prefix(prompt)
    assert m.prefix_len == 48
    m.pages[:] = 0
    got = c.admit("x", [*prompt, 7])
    with pytest.raises(ValueError, match="read-only"):
        got.pages[:] = 0  # the request's own row: shown, not handed over
    c.abort("x")
    assert c.digest() != digest  # the match and admit advanced the clock...
    c.check_integrity()  # ...but every page the tree holds is still its own
    assert c.match_prefix(prompt).pages.tolist() == got.pages[:12].tolist()
    assert got.pages[:12].tolist() != [0] * 12
