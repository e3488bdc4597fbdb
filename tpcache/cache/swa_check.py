"""The full walk of ``check_integrity()`` for the hybrid tree (tests and idle time)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import CACHED
from tpcache.cache.errors import IntegrityError
from tpcache.cache.hashing import ROOT_STATE
from tpcache.cache.tree import page_terms

if TYPE_CHECKING:
    from tpcache.cache.swa_tree import SwaNode, SwaTree

_MASK = (1 << 64) - 1


def check_tree(tree: SwaTree) -> None:
    """Walk the whole tree and recount; raise ``IntegrityError`` naming what broke.

    Checks the shape and hash chains, lock order (``0 <= swa_lock <= lock``, a node's
    lock covers its children's), tombstones (never a leaf, never SWA-locked, no SWA
    pages), that every leaf is a valid match end, both eviction orders (the full heap
    holds exactly the unlocked leaves, the SWA heap exactly the non-tombstones that are
    not SWA-locked), the boundary marks, the counters and the digest.
    """
    nodes = tree.walk()
    if len(nodes) + 1 != len(tree.nodes):
        raise IntegrityError(f"tree walk finds {len(nodes)} nodes, index has {len(tree.nodes) - 1}")
    live = {(k, n.id) for k, n in tree._heap if n.queued == k}
    swa_live = {(k, n.id) for k, n in tree._swa_heap if n.swa_queued == k}
    marks: dict[int, int] = {tree.root.mark: 0}
    totals = np.zeros(6, dtype=np.int64)  # pages, protected, swa, swa protected, tombs, tomb pages
    digest = 0
    all_pages = []
    for node in nodes:
        _check_node(tree, node)
        size = node.pages.size
        if node.mark:
            if node.mark in marks:
                raise IntegrityError(
                    f"nodes {marks[node.mark]} and {node.id} share mark {node.mark}"
                )
            marks[node.mark] = node.id
        if (
            node.lock == 0
            and not node.children
            and (node.queued != tree.key_fn(node) or (node.queued, node.id) not in live)
        ):
            raise IntegrityError(f"unlocked leaf {node.id} is not in the full eviction order")
        if node.swa_lock == 0 and not node.tombstone:
            if node.swa_queued != tree.key_fn(node) or (node.swa_queued, node.id) not in swa_live:
                raise IntegrityError(f"node {node.id} with SWA KV is not in the SWA eviction order")
        elif node.swa_queued is not None:
            raise IntegrityError(f"node {node.id} is in the SWA eviction order but may not be")
        totals += (
            size,
            size if node.lock else 0,
            0 if node.tombstone else size,
            size if node.swa_lock else 0,
            1 if node.tombstone else 0,
            size if node.tombstone else 0,
        )
        all_pages.append(node.pages)
        term = page_terms(node.states, node.pages)
        if term != node.term:
            raise IntegrityError(f"node {node.id}: digest term {node.term:#x} != {term:#x}")
        digest += term
    counters = (
        tree.cached_pages,
        tree.protected_pages,
        tree.swa_pages,
        tree.swa_protected,
        tree.tombstones,
        tree.tombstone_pages,
    )
    if tuple(totals.tolist()) != counters:
        raise IntegrityError(
            "tree recount (pages, protected, swa, swa protected, tombstones, tombstone pages)"
            f" = {tuple(totals.tolist())}, counters say {counters}"
        )
    if tree.alloc.full.count(CACHED) != tree.cached_pages:
        raise IntegrityError(
            f"full pool has {tree.alloc.full.count(CACHED)} cached pages, tree {tree.cached_pages}"
        )
    if tree.alloc.swa_count(CACHED) != tree.swa_pages:
        raise IntegrityError(
            f"{tree.alloc.swa_count(CACHED)} cached full pages map SWA pages, tree {tree.swa_pages}"
        )
    if all_pages:
        flat = np.concatenate(all_pages)
        if np.unique(flat).size != flat.size:
            raise IntegrityError("a page is referenced by two tree nodes")
        if (tree.alloc.full.tags_of(flat) != CACHED).any():
            raise IntegrityError("a tree page is not tagged cached in the full pool")
    if digest & _MASK != tree.digest_sum:
        raise IntegrityError(f"tree digest {tree.digest_sum:#x} != recomputed {digest & _MASK:#x}")


def _check_node(tree: SwaTree, node: SwaNode) -> None:
    ps = tree.ps
    parent = node.parent
    if parent is None or not node.alive or tree.nodes.get(node.id) is not node:
        raise IntegrityError(f"node {node.id} is detached or not indexed")
    if parent.children.get(node.kb[: 4 * ps]) is not node:
        raise IntegrityError(f"node {node.id} is not under its first-page key in its parent")
    if not node.kb or node.ntok * 4 != len(node.kb) or node.ntok != node.pages.size * ps:
        raise IntegrityError(
            f"node {node.id}: {len(node.kb) // 4} tokens ({node.ntok} counted) for"
            f" {node.pages.size} pages of {ps}"
        )
    if node.pages.dtype != np.int64:
        raise IntegrityError(f"node {node.id}: pages of dtype {node.pages.dtype}")
    if node.states.size != node.pages.size:
        raise IntegrityError(
            f"node {node.id}: {node.states.size} hash states, {node.pages.size} pages"
        )
    parent_state = int(parent.states[-1]) if parent.states.size else ROOT_STATE
    if not np.array_equal(tree.hasher.chain(node.key, parent_state), node.states):
        raise IntegrityError(f"node {node.id}: block hash chain does not match its tokens")
    if node.lock < 0 or node.swa_lock < 0:
        raise IntegrityError(f"node {node.id} has lock {node.lock}, SWA lock {node.swa_lock}")
    if node.swa_lock > node.lock:
        raise IntegrityError(
            f"node {node.id}: SWA lock {node.swa_lock} above its full lock {node.lock}"
        )
    child_locks = sum(c.lock for c in node.children.values())
    if node.lock < child_locks:
        raise IntegrityError(f"node {node.id} lock {node.lock} < its children's {child_locks}")
    has_swa = tree.alloc.has_swa(node.pages)
    if node.tombstone:
        if not node.children:
            raise IntegrityError(f"tombstone {node.id} is a leaf")
        if node.swa_lock:
            raise IntegrityError(f"tombstone {node.id} is SWA-locked ({node.swa_lock})")
        if has_swa.any():
            raise IntegrityError(f"tombstone {node.id} still maps SWA pages")
    elif not has_swa.all():
        raise IntegrityError(f"node {node.id} lacks SWA pages but is not a tombstone")
    if not node.children and not tree.valid_end(node):
        raise IntegrityError(
            f"leaf {node.id} follows a tombstone by less than the window ({tree.window})"
        )
