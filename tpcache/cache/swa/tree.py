"""The sliding window on the radix tree: full KV for every cached token, SWA KV only where
it is visible.

``SwaTree`` is ``RadixTree`` (``tree.py``: nodes, walks, splits, inserts, locks, the
eviction of unlocked leaves, events, checks) plus what the window adds, through the
tree's hooks:

- SWA pages: one per full page of a node, through the paired allocator's mapping.
- Tombstones: a node whose SWA KV was dropped keeps its full KV, so a match may run
  through it, but may end only where the last ``window`` tokens before the end have SWA
  KV (or where the path has no tombstone at all); the count restarts at every
  tombstone. Every leaf stays a valid match end. An insert that gives a tombstone's
  pages anew revives it (its SWA pages move onto the tombstone's full pages).
- The boundary lock: full KV up to the root (``lock``), SWA KV of the last ``window``
  tokens (``swa_lock``, up to the *boundary* node, inclusive), named by a mark that a
  split moves to the upper half, so an unlock stops where its lock stopped.
  ``swa_lock <= lock`` on every node, always.
- A second eviction order, SWA KV (``swa_evict.py``); its checks are in ``swa_check.py``.

Internal: ``HybridCache`` is the public face and hands out handles, never nodes.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import CACHED
from tpcache.cache.errors import LockError, StaleBoundary
from tpcache.cache.policy.order import EvictionOrder
from tpcache.cache.policy.policies import KeyFn
from tpcache.cache.swa.allocator import PairedAllocator
from tpcache.cache.swa.check import WindowCheck
from tpcache.cache.swa.evict import evict_window, live_tombstone_pages
from tpcache.cache.swa.inserts import check_new_leaf, revivable, revive_tombstones
from tpcache.cache.tree.anchors import BASE_LOCK
from tpcache.cache.tree.node import SwaNode, window_cut
from tpcache.cache.tree.shapes import Freed
from tpcache.cache.tree.tree import Match, RadixTree

ROOT_MARK = 1  # the root's boundary mark: an SWA lock that runs up the whole path


class SwaTree(RadixTree[SwaNode]):
    """``RadixTree`` with SWA pages, tombstones, the boundary lock, window-aware matches
    and a second eviction order.

    The tree owns its nodes and counters; the paired allocator owns page tags and the
    SWA mapping. Pages lose only their SWA part when their node becomes a tombstone.
    """

    node_type = SwaNode
    window: int  # tokens a lock keeps SWA KV for (never None here)
    root: SwaNode  # made by the base tree's ``clear`` from ``node_type``

    def __init__(
        self,
        alloc: PairedAllocator,
        key_fn: KeyFn,
        window: int,
        swa_key_fn: KeyFn,
        *,
        record_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        self.window = window
        # The SWA order's key (``swa_evict.swa_policy_key``): it reads the SWA recency,
        # so a touch requeues only a path's last window.
        self.swa_key_fn = swa_key_fn
        self.evicted_swa_pages = 0  # SWA pages freed by eviction (tombstoning included)
        self.tombstoned_nodes = 0  # nodes that became tombstones since creation
        # Marks only grow, across reset too: an old handle never names a new boundary.
        self._next_mark = ROOT_MARK + 1
        super().__init__(alloc, key_fn, record_events=record_events, medium=medium)

    def clear(self) -> None:
        super().clear()
        self.root.swa_lock = 1
        self.root.mark = ROOT_MARK
        self.swa_pages = 0  # SWA pages in the tree (pages of non-tombstones)
        self.swa_protected = 0  # SWA pages of nodes with swa_lock > 0
        self.tombstones = 0  # tombstone nodes
        self.tombstone_pages = 0  # their full pages
        self.swa_order = EvictionOrder(self.swa_key_fn)  # nodes with SWA KV, not SWA-locked

    # ---- matches ------------------------------------------------------------------------
    def match_walk(self, key: np.ndarray, n: int, start: SwaNode | None = None) -> Match:
        """The longest *window-valid* cached prefix of ``key[:n]`` (``node.window_cut``)
        from the root or an anchor ``start``, changing nothing."""
        found = self.descend(key, n, start)
        return window_cut(*found, self.window) if self.tombstones else found

    def valid_end(self, node: SwaNode, acc: int = 0) -> bool:
        """May a match end at ``node``'s end (its last window, or whole path, has SWA KV)?

        ``acc``: tokens with SWA KV already known to follow ``node``'s end.
        """
        w, root = self.window, self.root
        if acc >= w:
            return True
        while node is not root:
            if node.tombstone:
                return False
            acc += node.ntok
            if acc >= w:
                return True
            node = node.parent  # type: ignore[assignment]
        return True

    def split(self, child: SwaNode, at: int) -> SwaNode:
        """``RadixTree.split``; the upper half also takes the SWA use, the SWA lock, the
        tombstone state and the boundary mark (an SWA lock that stopped at the whole node
        stops at its top)."""
        upper: SwaNode = super().split(child, at)
        upper.swa_access = child.swa_access
        upper.swa_hits = child.swa_hits
        upper.swa_lock = child.swa_lock
        upper.tombstone = child.tombstone
        if child.tombstone:
            self.tombstones += 1
        upper.mark, child.mark = child.mark, 0
        child.ntok -= at
        self.queue_swa(upper)
        return upper

    def touch(self, path: list[SwaNode], queue: bool = True) -> None:
        """``RadixTree.touch``; a hit on the SWA KV of the path's last window too."""
        super().touch(path, queue)
        if path:
            self._touch_window(path[-1], self.tick, hit=True)

    def _touch_window(self, node: SwaNode, tick: int, hit: bool) -> None:
        """Mark the SWA KV of the last ``window`` tokens ending at ``node`` as used."""
        w, root = self.window, self.root
        acc = 0
        while node is not root and acc < w:
            node.swa_access = tick
            if hit:
                node.swa_hits += 1
            if not node.swa_lock and not node.tombstone:  # alive: on a path
                self.swa_order.push(node)
            acc += node.ntok
            node = node.parent  # type: ignore[assignment]

    # ---- inserts: revival and the new leaf's window --------------------------------------
    # An insert over tombstones (``swa_inserts.py``): the functions take the tree first.
    revivable = revivable
    check_new_leaf = check_new_leaf
    revive = revive_tombstones

    def reprioritised(self, node: SwaNode) -> None:
        if not node.swa_lock and not node.tombstone:
            self.queue_swa(node)

    def inserted(self, end: SwaNode, tick: int, new_pages: int) -> None:
        if new_pages:  # a new leaf, with the SWA pages of its own
            self.swa_pages += new_pages
            self.swa_order.push(end)  # alive, no tombstone, not locked
        if end is not self.root:
            self._touch_window(end, tick, hit=False)

    # ---- the boundary lock --------------------------------------------------------------
    def boundary(self, node: SwaNode) -> SwaNode:
        """The node where the last ``window`` tokens ending at ``node`` begin (the path's
        top node if it is shorter; the root for the root)."""
        root, w = self.root, self.window
        acc = 0
        while node is not root:
            acc += node.ntok
            if acc >= w or node.parent is root:
                return node
            node = node.parent  # type: ignore[assignment]
        return root

    def mark_of(self, top: SwaNode) -> int:  # type: ignore[override]
        """The boundary mark of ``top``, giving it one if it has none."""
        if top.mark == 0:
            top.mark = self._next_mark
            self._next_mark += 1
        return top.mark

    def find_top(self, node: SwaNode, mark: int) -> SwaNode:
        """The node with ``mark`` on the path from ``node`` up; ``StaleBoundary`` if none.
        Marks given out start at 1: 0 is an unmarked node's, never a boundary."""
        if mark < 1:
            raise StaleBoundary(f"boundary mark {mark} was never given out")
        cur: SwaNode | None = node
        while cur is not None:
            if cur.mark == mark:
                return cur
            cur = cur.parent
        raise StaleBoundary(f"boundary mark {mark} is not on the path of node {node.id}")

    def lock(self, node: SwaNode, top: SwaNode | None = None) -> None:
        """``RadixTree.lock``, and with ``top`` (a ``boundary``) the SWA lock of the lock's
        last window: ``node`` up to ``top``, inclusive (two-level locks)."""
        super().lock(node)
        if top is not None:
            self._lock_window(node, top, 1)

    def unlock(self, node: SwaNode, top: SwaNode | None = None) -> None:
        """Undo one ``lock(node, top)``; raises as ``RadixTree.unlock``, changing nothing."""
        super().unlock(node)
        if top is not None:
            self._lock_window(node, top, -1)

    def _lock_window(self, node: SwaNode, top: SwaNode, step: int) -> None:
        """Add ``step`` to the SWA lock of ``node`` up to ``top`` (never the root); a node
        whose SWA lock leaves or comes back to 0 changes its SWA order and counters."""
        root, locking = self.root, step > 0
        while node is not root:
            node.swa_lock += step
            if node.swa_lock == locking:  # 1 after a lock, 0 after an unlock
                self._swa_locked(node, locking)
            if node is top:
                return
            node = node.parent  # type: ignore[assignment]

    def new_anchor(self, key: bytes) -> SwaNode:
        """``RadixTree.new_anchor``; an anchor has no tokens and its base SWA lock, so it is
        never in the SWA order."""
        anchor: SwaNode = super().new_anchor(key)
        anchor.ntok = 0
        anchor.swa_lock = BASE_LOCK
        return anchor

    def check_lockable(self, node: SwaNode, top: SwaNode) -> None:  # type: ignore[override]
        """Raise ``LockError`` if the SWA part ``node..top`` has a tombstone."""
        cur = node
        while cur is not self.root:
            if cur.tombstone:
                raise LockError(
                    f"node {cur.id} in the last window of node {node.id} lost its SWA KV"
                )
            if cur is top:
                return
            cur = cur.parent  # type: ignore[assignment]

    def _swa_locked(self, node: SwaNode, locked: bool) -> None:
        """The SWA lock count of ``node`` left 0 (``locked``) or came back to 0."""
        if locked:
            self.swa_protected += node.pages.size
            self.swa_order.forget(node)
        else:
            self.swa_protected -= node.pages.size
            self.swa_order.push(node)  # alive (locked until now), so no tombstone

    # ---- eviction (the SWA order: ``swa_evict.py``) ---------------------------------------
    def queue_swa(self, node: SwaNode) -> None:
        if not (node.swa_lock or node.tombstone) and node.alive:  # free SWA KV
            self.swa_order.push(node)

    def evict_window(self, num_pages: int, out: Freed) -> None:
        evict_window(self, num_pages, out)

    def deleted(self, node: SwaNode, out: Freed) -> None:
        self.leaves.live.pop(node, None)  # .forget(node), without the call
        self.swa_order.live.pop(node, None)
        size = node.pages.size
        if node.tombstone:
            self.tombstones -= 1
            self.tombstone_pages -= size
        else:
            out.swa += size
            self.swa_pages -= size

    def free_evicted(self, pages: np.ndarray, out: Freed) -> None:
        # A node tombstoned and then deleted in this call still maps its SWA pages, so
        # freeing it whole frees them: only live tombstones free their SWA part alone.
        tombs = live_tombstone_pages(out)
        if pages.size or tombs.size:
            self.alloc.release(pages, tombs, CACHED, checked=False)
        self.evicted_swa_pages += out.swa

    # ---- per-pool views -----------------------------------------------------------------
    def pool_pages(self) -> tuple[tuple[int, int], ...]:
        return (self.cached_pages, self.protected_pages), (self.swa_pages, self.swa_protected)

    def digest_fields(self) -> tuple[int, ...]:
        return self.swa_protected, self.tombstone_pages, self.tombstones

    def evicted(self) -> tuple[int, ...]:
        return self.evicted_pages, self.evicted_swa_pages

    def evictable_after_lock(
        self, path: list[SwaNode], partial: SwaNode | None, common: int
    ) -> tuple[int, ...]:
        """The full pool's as the base tree's; SWA: the match's last window is pinned."""
        (full,) = super().evictable_after_lock(path, partial, common)
        pinned = acc = 0
        if partial is not None:
            pinned += common // self.ps if partial.swa_lock == 0 else 0
            acc = common
        for p in reversed(path):
            if acc >= self.window:
                break
            acc += p.ntok
            pinned += p.pages.size if p.swa_lock == 0 else 0
        return full, self.swa_pages - self.swa_protected - pinned

    def locks_of(self, node: SwaNode) -> tuple[int, ...]:
        return node.lock, node.swa_lock

    def check_window(self) -> WindowCheck:
        return WindowCheck(self)
