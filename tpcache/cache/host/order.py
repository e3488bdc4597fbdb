"""``RunOrder``: an ``EvictionOrder`` whose entries pushed in ascending key order skip
the heap: the tiered tree's two orders (``host_tree.py``).

Why: most keys arrive in order. A node's key is its policy key, and what the tiered
tree queues comes mostly in policy order: write-backs leave the device lowest key first
and join the host order so (a host-only node's key never changes), parents follow their
children, and a request's path is queued with the newest tick when it finishes. An
entry whose key is above every key queued in ``tail`` so far is appended there (a
sorted run: no comparisons up a heap of cold entries); any other goes in the heap. A
pop takes the lower of the two heads, so nodes come out in exactly the order the heap
alone would give (keys are unique: each ends in the node id), and stale entries are
skipped as there.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from tpcache.cache.policy.order import EvictionOrder
from tpcache.cache.policy.policies import KeyFn


class RunOrder(EvictionOrder):
    """``EvictionOrder``'s contract; entries live in ``heap`` or in the sorted ``tail``.
    Owned as ``EvictionOrder``."""

    __slots__ = ("tail",)

    def __init__(self, key_fn: KeyFn) -> None:
        super().__init__(key_fn)
        self.tail: deque[tuple[tuple[int, ...], Any]] = deque()  # ascending keys

    def _queue(self, k: tuple[int, ...], node: Any) -> None:
        tail = self.tail
        if not tail or k > tail[-1][0]:
            tail.append((k, node))
        else:
            heapq.heappush(self.heap, (k, node))
        if len(self.heap) + len(tail) > 2 * len(self.live) + 1024:
            self.compact()

    def pop(self) -> Any:
        heap, tail, live = self.heap, self.tail, self.live
        while True:
            if heap and (not tail or heap[0][0] < tail[0][0]):
                k, node = heapq.heappop(heap)
            elif tail:
                k, node = tail.popleft()
            else:
                return None
            if live.get(node) == k:
                del live[node]
                return node

    def live_entries(self) -> set[tuple[tuple[int, ...], int]]:
        live = self.live
        return {(k, n.id) for k, n in (*self.heap, *self.tail) if live.get(n) == k}

    def rekey(self) -> None:
        # Every key may change: one sorted run of them all, and an empty heap.
        key_fn = self.key_fn
        self.live = {node: key_fn(node) for node in self.live}
        self.tail = deque(sorted(((k, node) for node, k in self.live.items()), key=_key))
        self.heap = []

    def compact(self) -> None:
        # Stale entries out of both, in linear time: the run stays sorted, the heap is
        # rebuilt from its live entries (as ``EvictionOrder.compact``, which heapifies).
        live = self.live
        self.tail = deque(e for e in self.tail if live.get(e[1]) == e[0])
        heap = [e for e in self.heap if live.get(e[1]) == e[0]]
        heapq.heapify(heap)
        self.heap = heap


def _key(entry: tuple[tuple[int, ...], Any]) -> tuple[int, ...]:
    return entry[0]
