"""Two-level locks of the hybrid tree (a mixin of ``SwaTree``).

A lock protects a node and its ancestors: their full KV (``lock``, up to the root) and
the SWA KV of the last ``window`` tokens of the path (``swa_lock``, up to the lock's
*boundary* node, inclusive). The boundary is named by a mark (``mark_of``) that a split
moves to the upper half, so an unlock stops exactly where its lock stopped even when the
tree changed in between. ``swa_lock <= lock`` on every node, always.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpcache.cache.errors import LockError
from tpcache.cache.swa_node import StaleBoundary

if TYPE_CHECKING:
    from tpcache.cache.swa_node import SwaNode
    from tpcache.cache.swa_tree import SwaTree


class SwaLocks:
    """Lock part of ``SwaTree`` (a mixin: it uses the tree's fields and counters)."""

    def boundary(self: SwaTree, node: SwaNode) -> SwaNode:
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

    def mark_of(self: SwaTree, node: SwaNode) -> int:
        """The boundary mark of ``node``, giving it one if it has none."""
        if node.mark == 0:
            node.mark = self._next_mark
            self._next_mark += 1
        return node.mark

    def find_top(self: SwaTree, node: SwaNode, mark: int) -> SwaNode:
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

    def check_lockable(self: SwaTree, node: SwaNode, top: SwaNode) -> None:
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

    def check_unlockable(self: SwaTree, node: SwaNode, top: SwaNode) -> None:
        """Raise ``LockError`` unless ``node..root`` is locked and ``node..top`` SWA-locked."""
        if node is self.root:
            return
        if node.lock <= 0:
            raise LockError(f"node {node.id} is not locked")
        cur = node
        while cur is not self.root:
            if cur.swa_lock <= 0:
                raise LockError(f"node {cur.id} is not SWA-locked (unlock of node {node.id})")
            if cur is top:
                return
            cur = cur.parent  # type: ignore[assignment]

    def lock(self: SwaTree, node: SwaNode, top: SwaNode) -> None:
        """Full-lock ``node`` up to the root and SWA-lock it up to ``top`` (inclusive)."""
        root = self.root
        swa = True
        while node is not root:
            if node.lock == 0:
                self.protected_pages += node.pages.size
            node.lock += 1
            if swa:
                if node.swa_lock == 0:
                    self.swa_protected += node.pages.size
                    node.swa_queued = None
                node.swa_lock += 1
                swa = node is not top
            node = node.parent  # type: ignore[assignment]

    def unlock(self: SwaTree, node: SwaNode, top: SwaNode) -> None:
        """Undo one ``lock(node, top)``; callers check with ``check_unlockable`` first."""
        root = self.root
        swa = True
        while node is not root:
            node.lock -= 1
            if node.lock == 0:
                self.protected_pages -= node.pages.size
                if not node.children:
                    self._queue(node)
            if swa:
                node.swa_lock -= 1
                if node.swa_lock == 0:
                    self.swa_protected -= node.pages.size
                    self._queue_swa(node)
                swa = node is not top
            node = node.parent  # type: ignore[assignment]
