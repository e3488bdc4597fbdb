"""The full walks of ``check_integrity()`` (tests and idle time), for every cache kind:
the whole cache (``check_cache``), the tree (``check_tree``) and every lock against the
requests and handles that hold it (``check_locks``). A tree with a window adds its
checks through ``check_window()`` (``swa_check.WindowCheck``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import CACHED, FREE, HELD, LENT
from tpcache.cache.errors import CacheError, IntegrityError
from tpcache.cache.tree.anchors import BASE_LOCK, check_anchor, check_spaces, is_anchor
from tpcache.cache.tree.node import MASK, page_terms, seed_of

if TYPE_CHECKING:
    from tpcache.cache.tallies import CacheShape
    from tpcache.cache.tree.node import Node
    from tpcache.cache.tree.shapes import TreeShape

Holder = tuple[Any, int, int]  # (node, boundary mark, lock count) of a request or a handle


def check_cache(cache: CacheShape) -> None:
    """Verify the conservation law per pool, the allocator, the tree, every request row
    and every lock; raise ``IntegrityError`` with the numbers."""
    several = cache.num_pools > 1
    for name, p in zip(cache.pool_names, cache.pool_sizes(), strict=True):
        total = p.free + p.evictable + p.protected + p.held
        if total != p.capacity:
            raise IntegrityError(
                f"{name + ' pool: ' if several else ''}free {p.free} + evictable {p.evictable}"
                f" + protected {p.protected} + held {p.held} = {total} != capacity {p.capacity}"
            )
    alloc, tree, reqs = cache.alloc, cache.tree, cache.reqs
    counts = tuple(alloc.count(t) for t in (FREE, HELD, CACHED, LENT))
    if sum(counts) != alloc.num_pages:
        raise IntegrityError(f"allocator counts {counts} do not add up to {alloc.num_pages}")
    alloc.check_integrity()
    tree.check_integrity()
    reqs.check_integrity(tree, alloc)
    rows = reqs.held_pages()
    if rows != alloc.count(HELD):
        raise IntegrityError(
            f"request rows hold {rows} pages, but {alloc.count(HELD)} pages are tagged held"
        )
    running = [reqs.get(rid) for rid in reqs.ids()]
    check_locks(tree, [(r.node, r.mark, 1) for r in running] + cache.handles.holders())


def _check_pages(tree: TreeShape, all_pages: list[np.ndarray], pages_total: int) -> None:
    """The tree's pages against the allocator: as many cached, each once, each tagged."""
    if tree.alloc.count(CACHED) != pages_total:
        raise IntegrityError(
            f"allocator has {tree.alloc.count(CACHED)} cached pages, tree {pages_total}"
        )
    if all_pages:
        flat = np.concatenate(all_pages)
        if np.unique(flat).size != flat.size:
            raise IntegrityError("a page is referenced by two tree nodes")
        if (tree.alloc.tags_of(flat) != CACHED).any():
            raise IntegrityError("a tree page is not tagged cached in the allocator")


def check_tree(tree: TreeShape) -> None:
    """Walk the whole tree and recount; raise ``IntegrityError`` naming what broke.

    Checks the shape and hash chains, lock order (a node's lock covers its children's),
    that the eviction order holds exactly the unlocked leaves under their current keys,
    the counters, the pages (each once, tagged cached) and the digest; then the policy's
    state, and the window's checks.
    """
    tree.ensure_hashed()
    nodes = tree.walk()
    if len(nodes) + 1 != len(tree.nodes):
        raise IntegrityError(f"tree walk finds {len(nodes)} nodes, index has {len(tree.nodes) - 1}")
    window = tree.check_window()
    leaves = tree.leaves
    live = leaves.live_entries()
    pages_total = protected = 0
    all_pages = []
    digest = 0
    for node in nodes:
        if is_anchor(node):
            check_anchor(tree, node)
            continue
        check_node(tree, node)
        if node.lock == 0 and not node.children:
            k = leaves.key_of(node)
            if k != tree.key_fn(node) or (k, node.id) not in live:
                raise IntegrityError(f"unlocked leaf {node.id} is not in the eviction queue")
        pages_total += node.pages.size
        protected += node.pages.size if node.lock else 0
        all_pages.append(node.pages)
        term = page_terms(node.states, node.pages)
        if term != node.term:
            raise IntegrityError(f"node {node.id}: digest term {node.term:#x} != {term:#x}")
        digest += term
        if window is not None:
            window.node(node)
    names = ("pages", "protected")
    recount: tuple[int, ...] = (pages_total, protected)
    counters: tuple[int, ...] = (tree.cached_pages, tree.protected_pages)
    if window is not None:
        names += window.names
        recount += tuple(window.totals)
        counters += window.counters()
    if recount != counters:
        raise IntegrityError(
            f"tree recount ({', '.join(names)}) = {recount}, counters say {counters}"
        )
    _check_pages(tree, all_pages, pages_total)
    check_spaces(tree)
    if digest & MASK != tree.digest_sum:
        raise IntegrityError(f"tree digest {tree.digest_sum:#x} != recomputed {digest & MASK:#x}")
    if window is not None:
        window.finish()
    if tree.hooks is not None:
        tree.hooks.check_integrity()


def check_node(tree: TreeShape, node: Node) -> None:
    ps = tree.ps
    parent = node.parent
    if parent is None or not node.alive or tree.nodes.get(node.id) is not node:
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
    parent_state = int(parent.states[-1]) if parent.states.size else seed_of(tree, parent)
    if not np.array_equal(tree.hasher.chain(node.key, parent_state), node.states):
        raise IntegrityError(f"node {node.id}: block hash chain does not match its tokens")


def check_locks(tree: TreeShape, holders: list[Holder]) -> None:
    """Every node's lock counts are exactly those of the requests and handle locks at or
    below it: the full lock up to the root and, with a window, the SWA lock up to each
    one's boundary."""
    windowed = tree.window is not None
    full: dict[int, int] = {}
    swa: dict[int, int] = {}
    root = tree.root
    for node, mark, count in holders:
        try:
            top = tree.find_top(node, mark)
        except CacheError as exc:
            raise IntegrityError(f"a lock on node {node.id}: {exc}") from None
        in_window = windowed
        while node is not root:
            full[node.id] = full.get(node.id, 0) + count
            if in_window:
                swa[node.id] = swa.get(node.id, 0) + count
                in_window = node is not top
            node = node.parent
    kinds = "(full, SWA)" if windowed else "(full)"
    for node in tree.walk():
        have = tree.locks_of(node)
        base = BASE_LOCK if is_anchor(node) else 0
        want = (full.get(node.id, 0) + base, swa.get(node.id, 0) + base)[: len(have)]
        if have != want:
            raise IntegrityError(
                f"node {node.id} has locks {kinds} {have}, but requests and handles hold {want}"
            )
