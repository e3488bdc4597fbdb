"""The full walks of ``HybridCache.check_integrity()`` (tests and idle time): the tree,
the request rows, and every lock against its holders."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import CACHED, HELD, LENT
from tpcache.cache.errors import CacheError, IntegrityError
from tpcache.cache.hashing import ROOT_STATE
from tpcache.cache.node import page_terms

if TYPE_CHECKING:
    from tpcache.cache.reqtable import ReqTable, RequestId
    from tpcache.cache.swa_node import SwaNode
    from tpcache.cache.swa_tree import SwaTree

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
            k = tree.swa_key_fn(node)
            if node.swa_queued != k or (k, node.id) not in swa_live:
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


def check_requests(tree: SwaTree, reqs: ReqTable, tops: dict[RequestId, int]) -> None:
    """Held pages are the rows' own; every held or lent full page has its SWA page; each
    running request has a lock boundary."""
    rows = reqs.held_pages()
    a = tree.alloc
    if rows != a.full.count(HELD):
        raise IntegrityError(
            f"request rows hold {rows} pages, but {a.full.count(HELD)} pages are tagged held"
        )
    for tag, name in ((HELD, "held"), (LENT, "lent")):
        if a.swa_count(tag) != a.full.count(tag):
            raise IntegrityError(
                f"{a.full.count(tag)} full pages are {name} but {a.swa_count(tag)} of"
                " them have SWA pages"
            )
    if list(tops) != reqs.ids():
        raise IntegrityError("lock boundaries and running requests differ")


def check_locks(
    tree: SwaTree,
    reqs: ReqTable,
    tops: dict[RequestId, int],
    handle_locks: dict[tuple[int, int], int],
) -> None:
    """Every node's full and SWA lock counts are exactly those of the requests and handle
    locks at or below it (SWA: up to each one's boundary)."""
    holders = [(reqs.get(rid).node, tops[rid], 1) for rid in reqs.ids()]
    for (node_id, mark), count in handle_locks.items():
        node = tree.nodes.get(node_id)
        if node is None:
            raise IntegrityError(f"handle {node_id} holds {count} locks on a node that is gone")
        holders.append((node, mark, count))
    full: dict[int, int] = {}
    swa: dict[int, int] = {}
    root = tree.root
    for node, mark, count in holders:
        try:
            top = tree.find_top(node, mark)
        except CacheError as exc:
            raise IntegrityError(f"a lock on node {node.id}: {exc}") from None
        in_window = True
        while node is not root:
            full[node.id] = full.get(node.id, 0) + count
            if in_window:
                swa[node.id] = swa.get(node.id, 0) + count
                in_window = node is not top
            node = node.parent  # type: ignore[assignment]
    for node in tree.walk():
        want = (full.get(node.id, 0), swa.get(node.id, 0))
        if (node.lock, node.swa_lock) != want:
            raise IntegrityError(
                f"node {node.id} has locks (full, SWA) {(node.lock, node.swa_lock)}, but"
                f" requests and handles hold {want}"
            )
