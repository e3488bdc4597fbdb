"""The six eviction orders, asserted exactly, at page size 1 and 4.

One scenario serves every policy. Four leaves under the root, inserted in order
A (priority 2), B (1), C (2), D (1); then A is matched twice and B once. So:
  last access  A:6 B:7 C:3 D:4     hits  A:2 B:1 C:0 D:0     created  A:1 B:2 C:3 D:4
"""

from __future__ import annotations

import pytest

from tpcache.cache.policy.policies import POLICIES
from tpcache.cache.radix import CacheConfig, RadixCache

EXPECTED = {
    "lru": "CDAB",
    "mru": "BADC",
    "fifo": "ABCD",
    "filo": "DCBA",
    "lfu": "CDBA",  # B was matched once, A twice: A outlives B although B is more recent
    "priority": "DBCA",  # lower priority first (D, B), ties by recency
}


def _leaf_tokens(name: str, page_size: int) -> list[int]:
    base = 10 * (ord(name) - ord("A") + 1)
    return [base + i for i in range(page_size)]


def _evict_one_at_a_time(cache: RadixCache, names: str, page_size: int) -> str:
    first_page = {tuple(_leaf_tokens(n, page_size)): n for n in names}
    order = ""
    while cache.tree.cached_pages:
        before = {tuple(n.key.tolist()) for n in cache.tree.walk()}
        got = cache.evict(1)
        assert (got.num_tokens, got.num_nodes) == (page_size, 1)
        after = {tuple(n.key.tolist()) for n in cache.tree.walk()}
        (gone,) = before - after
        order += first_page[gone]
        cache.check_integrity()
    return order


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_order(policy: str, page_size: int) -> None:
    assert set(EXPECTED) == set(POLICIES)
    c = RadixCache(CacheConfig(64, page_size, policy))
    for name, prio in zip("ABCD", (2, 1, 2, 1), strict=True):
        toks = _leaf_tokens(name, page_size)
        assert c.insert(toks, c.alloc_slots(page_size), priority=prio) == 0
    for name in "AAB":
        assert c.match_prefix(_leaf_tokens(name, page_size)).prefix_len == page_size
    assert _evict_one_at_a_time(c, "ABCD", page_size) == EXPECTED[policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_hits_and_ticks_come_through_admit_and_finish(policy: str) -> None:
    # The same history driven by requests: a request's match is a hit and an access,
    # its finish inserts with the request's priority.
    c = RadixCache(CacheConfig(64, 1, policy))
    prio = dict(zip("ABCD", (2, 1, 2, 1), strict=True))
    for i, name in enumerate("ABCD"):
        c.admit(i, [*_leaf_tokens(name, 1), 0], priority=prio[name])
        c.finish(i)  # caches [x, 0]: one node of 2 tokens
    for i, name in enumerate("AAB", start=10):
        got = c.admit(i, [*_leaf_tokens(name, 1), 0, 7])  # priority 0: never lowers a node's
        assert got.prefix_len == 2
        c.abort(i)
    first = {_leaf_tokens(n, 1)[0]: n for n in "ABCD"}
    order = ""
    while c.tree.cached_pages:
        before = {int(n.key[0]) for n in c.tree.walk()}
        assert c.evict(1).num_nodes == 1
        (gone,) = before - {int(n.key[0]) for n in c.tree.walk()}
        order += first[gone]
    assert order == EXPECTED[policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_children_go_before_their_parent_whatever_the_policy(policy: str) -> None:
    c = RadixCache(CacheConfig(64, 1, policy))
    c.insert([1, 2], c.alloc_slots(2), priority=0)
    c.insert([1, 2, 3], c.alloc_slots(3), priority=9)
    c.insert([1, 2, 4], c.alloc_slots(3), priority=9)  # [1,2] -> {[3], [4]}
    c.match_prefix([1, 2])  # the parent is the most recent and most hit
    order = []
    while c.tree.cached_pages:
        before = {tuple(n.key.tolist()) for n in c.tree.walk()}
        c.evict(1)
        order.append(before - {tuple(n.key.tolist()) for n in c.tree.walk()})
    assert order[-1] == {(1, 2)}
    assert len(order) == 3


def test_lfu_hit_counts_survive_a_split() -> None:
    c = RadixCache(CacheConfig(64, 1, "lfu"))
    c.insert([1, 2, 3, 4], c.alloc_slots(4))
    c.insert([9], c.alloc_slots(1))
    for _ in range(3):
        c.match_prefix([1, 2, 3, 4])
    c.match_prefix([9])
    c.match_prefix([9])
    c.match_prefix([1, 2, 7])  # splits [1,2] | [3,4]; [3,4] keeps 3 hits, [1,2] gets 4
    upper, lower, nine = c.tree.walk()
    assert (upper.hits, lower.hits, nine.hits) == (4, 3, 2)
    c.evict(1)
    assert [n.key.tolist() for n in c.tree.walk()] == [[1, 2], [3, 4]]
