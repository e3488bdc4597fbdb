"""The window's part of ``check_integrity()`` (``tree_check.check_tree`` calls it per
node, then once at the end): tombstones, SWA pages and locks, boundary marks, the SWA
eviction order and the window's counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpcache.cache.allocator import CACHED
from tpcache.cache.errors import IntegrityError

if TYPE_CHECKING:
    from tpcache.cache.tree.node import SwaNode
    from tpcache.cache.tree.shapes import SwaTreeShape


class WindowCheck:
    """One walk's state: the marks seen, the live SWA entries, the recounted counters.

    Per node: ``ntok`` is its token count; ``0 <= swa_lock <= lock``; a tombstone is
    never a leaf, never SWA-locked and maps no SWA page, every other node maps one per
    page; every leaf is a valid match end; marks are unique; the SWA order holds exactly
    the non-tombstones that are not SWA-locked, under their current keys.
    """

    names = ("swa", "swa protected", "tombstones", "tombstone pages")

    def __init__(self, tree: SwaTreeShape) -> None:
        self.tree = tree
        self.live = tree.swa_order.live_entries()
        self.marks: dict[int, int] = {tree.root.mark: 0}
        self.totals = [0, 0, 0, 0]  # as ``names``

    def counters(self) -> tuple[int, ...]:
        t = self.tree
        return t.swa_pages, t.swa_protected, t.tombstones, t.tombstone_pages

    def node(self, node: SwaNode) -> None:
        tree = self.tree
        size = node.pages.size
        if node.ntok * 4 != len(node.kb):
            raise IntegrityError(f"node {node.id}: {len(node.kb) // 4} tokens, {node.ntok} counted")
        if node.swa_lock < 0:
            raise IntegrityError(f"node {node.id} has lock {node.lock}, SWA lock {node.swa_lock}")
        if node.swa_lock > node.lock:
            raise IntegrityError(
                f"node {node.id}: SWA lock {node.swa_lock} above its full lock {node.lock}"
            )
        has_swa = tree.alloc.has_swa(node.pages)
        if node.tombstone:
            if not node.children:
                raise IntegrityError(f"tombstone {node.id} is a leaf")
            if node.swa_lock:
                raise IntegrityError(f"tombstone {node.id} is SWA-locked ({node.swa_lock})")
            if has_swa.any():
                raise IntegrityError(f"tombstone {node.id} still maps SWA pages")
            self.totals[2] += 1
            self.totals[3] += size
        else:
            if not has_swa.all():
                raise IntegrityError(f"node {node.id} lacks SWA pages but is not a tombstone")
            self.totals[0] += size
        if node.swa_lock:
            self.totals[1] += size
        if not node.children and not tree.valid_end(node):
            raise IntegrityError(
                f"leaf {node.id} follows a tombstone by less than the window ({tree.window})"
            )
        if node.mark:
            if node.mark in self.marks:
                raise IntegrityError(
                    f"nodes {self.marks[node.mark]} and {node.id} share mark {node.mark}"
                )
            self.marks[node.mark] = node.id
        order = tree.swa_order
        if node.swa_lock == 0 and not node.tombstone:
            k = tree.swa_key_fn(node)
            if order.key_of(node) != k or (k, node.id) not in self.live:
                raise IntegrityError(f"node {node.id} with SWA KV is not in the SWA eviction order")
        elif order.key_of(node) is not None:
            raise IntegrityError(f"node {node.id} is in the SWA eviction order but may not be")

    def finish(self) -> None:
        """The SWA pages the allocator maps from cached full pages are the tree's."""
        tree = self.tree
        mapped = tree.alloc.swa_count(CACHED)
        if mapped != tree.swa_pages:
            raise IntegrityError(f"{mapped} cached full pages map SWA pages, tree {tree.swa_pages}")
