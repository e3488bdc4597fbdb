"""The two eviction orders of the hybrid tree, and node deletion.

- Full order: unlocked leaves, as in ``tree.py``. Evicting one frees its full and SWA
  pages and deletes it.
- SWA order: every node that has SWA KV and is not SWA-locked, leaves or internal.
  Evicting a leaf deletes it (a tombstone may not be a leaf); evicting an internal node
  frees only its SWA pages and makes it a tombstone. Leaves below it that end less than
  a window after it could no longer be matched, so they go with it (they are never
  locked: a lock on one would SWA-lock the tombstoned node too).

The SWA order has its own recency: a node's SWA KV is used when the node lies in the
last window of a match or an insert (``swa_access``, ``swa_hits``), not whenever a path
runs through it, so a shared prefix far from where requests end loses its SWA KV first
and keeps its full KV. ``swa_policy_key`` gives the policy's SWA key.

Both are lazy heaps ordered by the policy key: an entry is used only if it is still the
node's live key (``queued`` / ``swa_queued``) and the node is still a candidate; a node
whose key changes is pushed again. A heap is rebuilt only when stale entries outnumber
live nodes, so each change costs O(log n) amortised and evicting k nodes O(k log n).

Deleting a leaf cascades: a parent that becomes a leaf and is no valid match end (a
tombstone, or less than a window after one) is deleted too. So every leaf stays a valid
match end. A block is announced removed only when its full KV goes; losing SWA KV is
no event.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import CACHED
from tpcache.cache.events import BlockRemoved
from tpcache.cache.hashing import block_hashes
from tpcache.cache.policies import KeyFn

if TYPE_CHECKING:
    from tpcache.cache.swa_node import SwaNode
    from tpcache.cache.swa_tree import SwaTree

_MASK = (1 << 64) - 1

# The policies of ``policies.py`` with the SWA recency in place of the node's recency.
SWA_POLICY_KEYS: dict[str, KeyFn] = {
    "lru": lambda n: (n.swa_access, n.id),
    "mru": lambda n: (-n.swa_access, n.id),
    "fifo": lambda n: (n.created, n.id),
    "filo": lambda n: (-n.created, n.id),
    "lfu": lambda n: (n.swa_hits, n.swa_access, n.id),
    "priority": lambda n: (n.priority, n.swa_access, n.id),
}


def swa_policy_key(name: str) -> KeyFn | None:
    """The SWA order's key of policy ``name``; ``None`` for a policy it does not know
    (the full order's key then serves for both)."""
    return SWA_POLICY_KEYS.get(name)


class _Freed:
    """What one ``evict`` call took; freed in one group per pool at the end."""

    __slots__ = ("dead", "full", "nodes", "swa", "terms", "tombs")

    def __init__(self) -> None:
        self.dead: list[SwaNode] = []  # deleted nodes (full pages, and SWA still mapped)
        self.tombs: list[SwaNode] = []  # nodes tombstoned in this call
        self.terms = 0  # the deleted nodes' digest terms
        self.full = 0
        self.swa = 0
        self.nodes = 0


class SwaEvictor:
    """Eviction part of ``SwaTree`` (a mixin: it uses the tree's fields and counters)."""

    # ---- queues -------------------------------------------------------------------------
    def _queue(self: SwaTree, node: SwaNode) -> None:
        if node.lock or node.children or not node.alive:
            return
        k = self.key_fn(node)
        if node.queued == k:
            return
        node.queued = k
        heapq.heappush(self._heap, (k, node))
        if len(self._heap) > 2 * len(self.nodes) + 1024:
            self._rebuild_heaps()

    def _queue_swa(self: SwaTree, node: SwaNode) -> None:
        if node.swa_lock or node.tombstone or not node.alive:
            return
        k = self.swa_key_fn(node)
        if node.swa_queued == k:
            return
        node.swa_queued = k
        heapq.heappush(self._swa_heap, (k, node))
        if len(self._swa_heap) > 2 * len(self.nodes) + 1024:
            self._rebuild_heaps()

    def _rebuild_heaps(self: SwaTree) -> None:
        heap, swa_heap = [], []
        key_fn, swa_key_fn = self.key_fn, self.swa_key_fn
        for node in self.nodes.values():
            node.queued = node.swa_queued = None
            if node.lock == 0 and not node.children:
                node.queued = key_fn(node)
                heap.append((node.queued, node))
            if node.swa_lock == 0 and not node.tombstone:
                node.swa_queued = swa_key_fn(node)
                swa_heap.append((node.swa_queued, node))
        heapq.heapify(heap)
        heapq.heapify(swa_heap)
        self._heap, self._swa_heap = heap, swa_heap

    # ---- eviction -----------------------------------------------------------------------
    def evict(self: SwaTree, full_pages: int, swa_pages: int = 0) -> tuple[int, int, int, int]:
        """Evict from the full order until ``full_pages`` full pages are freed, then from
        the SWA order until ``swa_pages`` SWA pages are freed (counting what the first
        phase freed), or until an order runs dry. Frees one group per pool.

        Returns (full pages freed, SWA pages freed, nodes deleted, nodes tombstoned).
        """
        started = time.perf_counter()
        out = _Freed()
        # Read the heaps each round: queueing a parent may rebuild them into new lists.
        while out.full < full_pages and self._heap:
            k, node = heapq.heappop(self._heap)
            if node.queued != k:
                continue
            node.queued = None
            if node.lock or node.children or not node.alive:
                continue
            self._delete(node, out)
        while out.swa < swa_pages and self._swa_heap:
            k, node = heapq.heappop(self._swa_heap)
            if node.swa_queued != k:
                continue
            node.swa_queued = None
            if node.swa_lock or node.tombstone or not node.alive:
                continue
            if node.children:
                self._tombstone(node, out)
            else:
                assert node.lock == 0, f"leaf {node.id} locked but not SWA-locked"
                self._delete(node, out)
        self._release(out)
        self.evicted_pages += out.full
        self.evicted_swa_pages += out.swa
        self.evict_seconds.append(time.perf_counter() - started)
        if len(self.evict_seconds) > 20_000:
            del self.evict_seconds[:10_000]
        return out.full, out.swa, out.nodes, len(out.tombs)

    def _delete(self: SwaTree, node: SwaNode, out: _Freed) -> None:
        """Delete unlocked leaf ``node``, then parents that became invalid leaves."""
        pb, root = 4 * self.ps, self.root
        while True:
            parent = node.parent
            assert parent is not None and node.lock == 0 and not node.children
            del parent.children[node.kb[:pb]]
            del self.nodes[node.id]
            node.alive = False
            node.queued = node.swa_queued = None
            size = node.pages.size
            out.dead.append(node)
            out.terms += node.term
            out.full += size
            out.nodes += 1
            self.cached_pages -= size
            if node.tombstone:
                self.tombstones -= 1
                self.tombstone_pages -= size
            else:
                out.swa += size
                self.swa_pages -= size
            if self.record_events:
                self.events.append(
                    BlockRemoved(
                        block_hashes=block_hashes(node.states).tolist(), medium=self.medium
                    )
                )
            if parent is root or parent.children:
                return
            if self.valid_end(parent):
                self._queue(parent)
                return
            node = parent

    def _tombstone(self: SwaTree, node: SwaNode, out: _Freed) -> None:
        """Drop the SWA KV of internal ``node``; delete leaves it leaves unmatchable."""
        size = node.pages.size
        node.tombstone = True
        node.swa_queued = None
        self.swa_pages -= size
        self.tombstones += 1
        self.tombstone_pages += size
        self.tombstoned_nodes += 1
        out.swa += size
        out.tombs.append(node)
        w = self.window
        doomed: list[SwaNode] = []
        stack = [(node, 0)]
        while stack:
            cur, depth = stack.pop()
            for child in cur.children.values():
                d = depth + child.ntok
                if d >= w:
                    continue
                if child.children:
                    stack.append((child, d))
                else:
                    doomed.append(child)
        for leaf in doomed:
            if leaf.alive:
                self._delete(leaf, out)

    def _release(self: SwaTree, out: _Freed) -> None:
        if not out.dead and not out.tombs:
            return
        dead = _cat([n.pages for n in out.dead])
        self.digest_sum = (self.digest_sum - out.terms) & _MASK
        # A node tombstoned and then deleted in this call still maps its SWA pages, so
        # freeing it whole frees them: only live tombstones free their SWA part alone.
        tombs = _cat([n.pages for n in out.tombs if n.alive])
        self.alloc.release(dead, tombs, CACHED, checked=False)


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
