"""An eviction order: candidates in policy-key order, kept lazily in a heap.

One class serves every order a tree keeps (its unlocked leaves; with the sliding window
also the nodes that hold SWA KV). The tree decides who is a candidate; the order only
remembers each node's live key.
"""

from __future__ import annotations

import heapq
from typing import Any

from tpcache.cache.policy.policies import KeyFn


class EvictionOrder:
    """Nodes in ascending policy key, popped lowest first.

    Why lazy: a node's key changes on every touch, and deleting from the middle of a
    heap costs O(n). So an entry is never removed when its node changes; ``live`` holds
    each queued node's current key, and a popped entry counts only if it still equals
    it. A changed key is pushed again. Stale entries are compacted away once they
    outnumber live ones, so a push costs O(log n) amortised and popping k nodes
    O(k log n). Every key ends in the node id, so the order is total and the same in
    every process.

    Owned by one tree, which pushes a node only while it is a candidate and checks a
    popped node's candidacy again (it may have changed since the push). ``live`` is
    keyed by node object (looked up, never iterated where order matters).
    """

    __slots__ = ("heap", "key_fn", "live")

    def __init__(self, key_fn: KeyFn) -> None:
        self.key_fn = key_fn
        self.heap: list[tuple[tuple[int, ...], Any]] = []
        self.live: dict[Any, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.live)

    def push(self, node: Any) -> None:
        """Queue ``node`` under its current key (nothing to do if that is its live key)."""
        k = self.key_fn(node)
        live = self.live
        if live.get(node) != k:
            live[node] = k
            self._queue(k, node)

    def _queue(self, k: tuple[int, ...], node: Any) -> None:
        """Keep the new live entry ``(k, node)`` for ``pop``, compacting once stale entries
        outnumber live ones: the one step of a push that a variant (``RunOrder``) does
        its own way, so the live keys are kept in one place."""
        heap = self.heap
        heapq.heappush(heap, (k, node))
        if len(heap) > 2 * len(self.live) + 1024:
            self.compact()

    def pop(self) -> Any:
        """The queued node with the lowest live key, no longer queued; ``None`` if none.
        The caller checks that it is still a candidate."""
        heap, live = self.heap, self.live
        while heap:
            k, node = heapq.heappop(heap)
            if live.get(node) == k:
                del live[node]
                return node
        return None

    def forget(self, node: Any) -> None:
        """Unqueue ``node`` (its heap entries become stale)."""
        self.live.pop(node, None)

    def key_of(self, node: Any) -> tuple[int, ...] | None:
        """The live key ``node`` is queued under, or ``None``."""
        return self.live.get(node)

    def rekey(self) -> None:
        """Recompute every queued node's key: the key function's state changed."""
        key_fn = self.key_fn
        self.live = {node: key_fn(node) for node in self.live}
        self.compact()

    def live_entries(self) -> set[tuple[tuple[int, ...], int]]:
        """(key, node id) of every heap entry that counts (for ``check_integrity``)."""
        live = self.live
        return {(k, n.id) for k, n in self.heap if live.get(n) == k}

    def compact(self) -> None:
        """Rebuild the heap from the live entries alone (changes no order)."""
        heap = [(k, node) for node, k in self.live.items()]
        heapq.heapify(heap)
        self.heap = heap
