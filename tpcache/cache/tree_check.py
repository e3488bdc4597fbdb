"""The full walk of ``RadixTree.check_integrity()`` (tests and idle time)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import CACHED
from tpcache.cache.errors import IntegrityError
from tpcache.cache.hashing import ROOT_STATE
from tpcache.cache.node import _MASK, page_terms

if TYPE_CHECKING:
    from tpcache.cache.tree import RadixTree


def check_tree(self: RadixTree) -> None:
    """Walk the whole tree and recount; raise ``IntegrityError`` naming what broke."""
    self.ensure_hashed()
    ps = self.ps
    nodes = self.walk()
    if len(nodes) + 1 != len(self.nodes):
        raise IntegrityError(f"tree walk finds {len(nodes)} nodes, index has {len(self.nodes) - 1}")
    pages_total = protected = 0
    all_pages = []
    digest = 0
    live = {(n.queued, n.id) for _, n in self._heap if n.queued is not None}
    for node in nodes:
        parent = node.parent
        if parent is None or not node.alive or self.nodes.get(node.id) is not node:
            raise IntegrityError(f"node {node.id} is detached or not indexed")
        if parent.children.get(node.kb[: 4 * ps]) is not node:
            raise IntegrityError(f"node {node.id} is not under its first-page key in its parent")
        if not node.kb or len(node.kb) != 4 * node.pages.size * ps:
            raise IntegrityError(
                f"node {node.id}: {len(node.kb) // 4} tokens for {node.pages.size} pages of {ps}"
            )
        if node.pages.dtype != np.int64:
            raise IntegrityError(f"node {node.id}: pages of dtype {node.pages.dtype}")
        if node.states.size != node.pages.size:
            raise IntegrityError(
                f"node {node.id}: {node.states.size} hash states, {node.pages.size} pages"
            )
        if node.lock < 0:
            raise IntegrityError(f"node {node.id} has lock {node.lock}")
        child_locks = sum(c.lock for c in node.children.values())
        if node.lock < child_locks:
            raise IntegrityError(f"node {node.id} lock {node.lock} < its children's {child_locks}")
        parent_state = int(parent.states[-1]) if parent.states.size else ROOT_STATE
        if not np.array_equal(self.hasher.chain(node.key, parent_state), node.states):
            raise IntegrityError(f"node {node.id}: block hash chain does not match its tokens")
        if (
            node.lock == 0
            and not node.children
            and (node.queued != self.key_fn(node) or (node.queued, node.id) not in live)
        ):
            raise IntegrityError(f"unlocked leaf {node.id} is not in the eviction queue")
        pages_total += node.pages.size
        protected += node.pages.size if node.lock else 0
        all_pages.append(node.pages)
        term = page_terms(node.states, node.pages)
        if term != node.term:
            raise IntegrityError(f"node {node.id}: digest term {node.term:#x} != {term:#x}")
        digest += term
    if pages_total != self.cached_pages or protected != self.protected_pages:
        raise IntegrityError(
            f"tree holds {pages_total} pages ({protected} protected), counters say "
            f"{self.cached_pages} ({self.protected_pages} protected)"
        )
    if self.alloc.count(CACHED) != pages_total:
        raise IntegrityError(
            f"allocator has {self.alloc.count(CACHED)} cached pages, tree {pages_total}"
        )
    if all_pages:
        flat = np.concatenate(all_pages)
        if np.unique(flat).size != flat.size:
            raise IntegrityError("a page is referenced by two tree nodes")
        if (self.alloc.tags_of(flat) != CACHED).any():
            raise IntegrityError("a tree page is not tagged cached in the allocator")
    if digest & _MASK != self.digest_sum:
        raise IntegrityError(f"tree digest {self.digest_sum:#x} != recomputed {digest & _MASK:#x}")
    if self.hooks is not None:
        self.hooks.check_integrity()
