"""check_integrity() catches every kind of corrupted state a test can plant."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tpcache.cache.allocator import FREE, HELD
from tpcache.cache.errors import IntegrityError
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.tree.node import page_terms


def _busy(page_size: int = 1) -> RadixCache:
    """A cached tree with a split, a running request on a cached prefix, a handle lock."""
    c = RadixCache(CacheConfig(64, page_size))
    ps = page_size
    a = list(range(1, 1 + 6 * ps))
    c.admit("done", a)
    c.finish("done")
    c.admit("done2", [*a[: 2 * ps], *range(100, 100 + 3 * ps)])
    c.finish("done2")  # splits a after 2 pages
    c.admit("run", [*a[: 4 * ps], 7])  # locks a's first 4 pages (another split)
    c.extend("run", 2 * ps)
    h = c.match_prefix([*range(100, 100 + 3 * ps)]).handle
    c.lock(h)
    c.lock(c.match_prefix(a).handle)
    c.check_integrity()
    return c


def _node_with(c: RadixCache, pred: Callable[[object], bool]):
    return next(n for n in c.tree.walk() if pred(n))


def _leaf(c: RadixCache):
    return _node_with(c, lambda n: not n.children and n.lock == 0)


def _inner(c: RadixCache):
    return _node_with(c, lambda n: n.children)


def _chain_node(c: RadixCache):
    return _node_with(c, lambda n: n.pages.size >= 2)


def _plant_double_reference(c: RadixCache) -> None:
    x, y = c.tree.walk()[:2]
    y.pages = y.pages.copy()
    y.pages[0] = x.pages[0]
    # keep the digest consistent, so that only the double reference is wrong
    old, y.term = y.term, page_terms(y.states, y.pages)
    c.tree.digest_sum = (c.tree.digest_sum - old + y.term) % 2**64


def _plant_leak(c: RadixCache) -> None:
    c.alloc.alloc(1, HELD)  # tagged held, consistently counted, in nobody's row


def _plant_row_prefix(c: RadixCache) -> None:
    req = c.reqs.get("run")
    req.pages[0], req.pages[1] = req.pages[1], req.pages[0]


def _plant_row_tokens(c: RadixCache) -> None:
    c.reqs.get("run").tokens[0] += 1


def _plant_row_cached_count(c: RadixCache) -> None:
    c.reqs.get("run").cached_pages -= 1


def _plant_row_own_page_free(c: RadixCache) -> None:
    req = c.reqs.get("run")
    req.pages[-1] = c.alloc._fifo[c.alloc._head]


def _plant_fifo(c: RadixCache) -> None:
    a = c.alloc
    a._fifo[a._head] = c.reqs.get("run").pages[-1]  # a held page queued as free


def _plant_fifo_duplicate(c: RadixCache) -> None:
    a = c.alloc
    a._fifo[(a._head + 1) % a.num_pages] = a._fifo[a._head]


def _plant_heap_drop(c: RadixCache) -> None:
    leaf = _leaf(c)
    c.tree.leaves.heap = [e for e in c.tree.leaves.heap if e[1] is not leaf]


def _plant_stale_queue_key(c: RadixCache) -> None:
    _leaf(c).last_access += 1000  # its queued key no longer matches the policy's


def _plant_child_lock(c: RadixCache) -> None:
    _leaf(c).lock += 1


def _plant_lock_count(c: RadixCache) -> None:
    # Consistent for the tree (child <= parent, protected pages right) but not what the
    # requests and handles hold.
    node = _inner(c)
    node.lock += 1


def _plant_negative_lock(c: RadixCache) -> None:
    _leaf(c).lock = -1


def _plant_hash_chain(c: RadixCache) -> None:
    node = _chain_node(c)
    key = node.key.copy()
    key[-1] += 1  # not the first page: the parent's child key still matches
    node.key = key


def _plant_state(c: RadixCache) -> None:
    node = _chain_node(c)
    node.states = node.states.copy()
    node.states[-1] ^= np.uint64(1)


def _plant_child_key(c: RadixCache) -> None:
    node = _leaf(c)
    parent = node.parent
    (k,) = [k for k, v in parent.children.items() if v is node]
    parent.children[b"\xff" * len(k)] = parent.children.pop(k)


def _plant_unindexed(c: RadixCache) -> None:
    del c.tree.nodes[_leaf(c).id]


PLANTS: dict[str, tuple[Callable[[RadixCache], None], str]] = {
    "cached counter": (
        lambda c: setattr(c.tree, "cached_pages", c.tree.cached_pages + 1),
        "!= capacity",
    ),
    "protected counter": (
        lambda c: setattr(c.tree, "protected_pages", c.tree.protected_pages - 1),
        "counters say",
    ),
    "allocator counter": (
        lambda c: c.alloc._counts.__setitem__(FREE, c.alloc._counts[FREE] + 1),
        "!= capacity",
    ),
    "digest sum": (lambda c: setattr(c.tree, "digest_sum", c.tree.digest_sum ^ 1), "digest"),
    "node digest term": (lambda c: setattr(_leaf(c), "term", _leaf(c).term ^ 1), "digest term"),
    "page referenced twice": (_plant_double_reference, "referenced by two tree nodes"),
    "leaked page": (_plant_leak, "tagged held"),
    "row prefix": (_plant_row_prefix, "row prefix"),
    "row tokens": (_plant_row_tokens, "tokens differ"),
    "row cached count": (_plant_row_cached_count, "row prefix of 3 pages"),
    "row own page free": (_plant_row_own_page_free, "own page is not tagged held"),
    "fifo holds a held page": (_plant_fifo, "not free"),
    "fifo duplicate": (_plant_fifo_duplicate, "distinct"),
    "leaf missing from queue": (_plant_heap_drop, "eviction queue"),
    "leaf queued under a stale key": (_plant_stale_queue_key, "eviction queue"),
    "child lock above parent": (_plant_child_lock, "its children's"),
    "lock count nobody holds": (_plant_lock_count, "requests and handles hold"),
    "negative lock": (_plant_negative_lock, "has lock -1"),
    "hash chain vs tokens": (_plant_hash_chain, "hash chain"),
    "hash state": (_plant_state, "hash chain"),
    "child under the wrong key": (_plant_child_key, "first-page key"),
    "node not indexed": (_plant_unindexed, "index has"),
    "handle lock on a gone node": (lambda c: c.handles.locks.__setitem__((10**6, 0), 1), "gone"),
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", list(PLANTS))
def test_integrity_fails_on_planted_corruption(name: str, page_size: int) -> None:
    c = _busy(page_size)
    plant, message = PLANTS[name]
    plant(c)
    with pytest.raises(IntegrityError, match=message):
        c.check_integrity()


def test_the_lock_check_sees_a_request_that_lost_its_lock() -> None:
    c = _busy()
    node = c.reqs.get("run").node
    c.tree.unlock(node)
    c.tree.lock(c.tree.root)  # no-op: counters stay consistent
    with pytest.raises(IntegrityError, match="lock"):
        c.check_integrity()
