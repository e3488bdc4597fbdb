"""The host tier's allocator and eviction orders against the base ones they stand for:
``HostPool`` (no tags kept) hands out the pages, and keeps the FIFO, fingerprint and
derived tags, of a ``PageAllocator``; ``RunOrder`` pops nodes in ``EvictionOrder``'s
order. Random op sequences; each test prints its seed."""

from __future__ import annotations

import numpy as np
import pytest

from tpcache.cache.allocator import CACHED, FREE, PageAllocator
from tpcache.cache.errors import AllocatorError, IntegrityError
from tpcache.cache.host.order import RunOrder
from tpcache.cache.host.pool import HostPool
from tpcache.cache.policy.order import EvictionOrder


def _fifo(a: PageAllocator) -> list[int]:
    return a.free_order()


@pytest.mark.parametrize("seed", range(8))
def test_host_pool_is_a_page_allocator_without_tags(seed: int) -> None:
    print("seed", seed)
    rng = np.random.default_rng(seed)
    a, b = HostPool(16, 1), PageAllocator(16, 1)
    every = np.arange(16)
    held: list[np.ndarray] = []  # allocated groups, still the caller's
    for _ in range(120):
        op = int(rng.integers(0, 4))
        if op == 0 or not held:
            k = int(rng.integers(0, a.num_free + 1))
            got = a.alloc(k, CACHED)
            assert got.tolist() == b.alloc(k, CACHED).tolist()
            held.extend(np.array_split(rng.permutation(got), int(rng.integers(1, 4))))
        elif op == 1:  # several groups at once, as a load frees them
            k = int(rng.integers(1, len(held) + 1))
            groups, held = held[:k], held[k:]
            a.free_groups([g.copy() for g in groups])
            for g in groups:
                b.free(g.copy(), CACHED, checked=False)
        elif op == 2:
            g = held.pop(0)
            a.free(g.copy(), CACHED, checked=False)
            b.free(g.copy(), CACHED, checked=False)
        else:
            g = np.concatenate(held)
            held = []
            n = int(rng.integers(0, g.size + a.num_free + 1))
            got = a.recycle(g.copy(), CACHED, n, CACHED)
            b.free(g.copy(), CACHED, checked=False)
            assert got.tolist() == b.alloc(n, CACHED).tolist()
            held.append(got)
        assert a.fingerprint() == b.fingerprint()
        assert _fifo(a) == _fifo(b)
        assert a.tags_of(every).tolist() == b.tags_of(every).tolist()
        a.check_integrity()


def test_host_pool_checks_derive_the_tags_from_the_fifo() -> None:
    a = HostPool(6, 1)
    got = a.alloc(4, CACHED)
    assert a.tags_of(np.arange(6)).tolist() == [CACHED] * 4 + [FREE] * 2
    a.free(got[:2].copy(), CACHED)  # checked: they are the tree's
    with pytest.raises(AllocatorError, match="is free"):
        a.free(got[:1].copy(), CACHED)  # a double free is still caught
    a._fifo[(a._head + 1) % a.num_pages] = a._fifo[a._head]  # a free page queued twice
    with pytest.raises(IntegrityError):
        a.check_integrity()


class _Node:
    def __init__(self, node_id: int, tick: int) -> None:
        self.id = node_id
        self.last_access = tick


def _lru(n: _Node) -> tuple[int, ...]:
    return (n.last_access, n.id)


@pytest.mark.parametrize("seed", range(8))
def test_run_order_pops_as_the_heap_does(seed: int) -> None:
    """Pushes mostly in key order (as the tiered tree's are), some not, keys changed
    while queued, forgets, compactions and rekeys: the same nodes come out in the same
    order."""
    print("seed", seed)
    rng = np.random.default_rng(seed)
    nodes = [_Node(i, int(rng.integers(0, 50))) for i in range(300)]
    runs, heap = RunOrder(_lru), EvictionOrder(_lru)
    tick = 50
    for step in range(6000):
        op = int(rng.integers(0, 10))
        node = nodes[int(rng.integers(0, len(nodes)))]
        if op < 5:  # a touch: the newest key, in order
            tick += 1
            node.last_access = tick
            runs.push(node)
            heap.push(node)
        elif op < 7:  # an old key: out of order
            node.last_access = int(rng.integers(0, tick))
            runs.push(node)
            heap.push(node)
        elif op < 8:
            runs.forget(node)
            heap.forget(node)
        elif step % 1500 == 0:  # every key changes at once (a stateful policy's rekey)
            for n in nodes:
                n.last_access = int(rng.integers(0, tick))
            runs.rekey()
            heap.rekey()
        else:
            assert runs.pop() is heap.pop(), f"step {step}"
        assert len(runs) == len(heap)
    assert {k for k, _ in runs.live_entries()} == {k for k, _ in heap.live_entries()}
    while (node := heap.pop()) is not None:
        assert runs.pop() is node
    assert runs.pop() is None
