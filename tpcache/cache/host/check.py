"""The full walk of a tiered tree's ``check_integrity()`` (``HostTree``): the base tree's
node checks, then the tiers: device nodes closed under parents, host-only nodes
unlocked with their ``pages`` the host copy's ids plus the offset, both eviction orders
exactly their candidates under current keys, every counter recounted, each pool's pages
owned once and tagged cached, and the digest sums recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import CACHED, FREE
from tpcache.cache.errors import IntegrityError
from tpcache.cache.host.moves import copy_term, has_dev_child
from tpcache.cache.tree.anchors import check_anchor, check_spaces, is_anchor
from tpcache.cache.tree.check import check_node
from tpcache.cache.tree.node import MASK, page_terms

if TYPE_CHECKING:
    from tpcache.cache.tree.shapes import HostTreeShape


def check_host_tree(tree: HostTreeShape) -> None:
    """Walk the whole tiered tree and recount; raise ``IntegrityError`` naming what broke."""
    tree.ensure_hashed()
    nodes = tree.walk()
    if len(nodes) + 1 != len(tree.nodes):
        raise IntegrityError(f"tree walk finds {len(nodes)} nodes, index has {len(tree.nodes) - 1}")
    dev_live = tree.leaves.live_entries()
    host_live = tree.host_leaves.live_entries()
    cached = protected = host = copies = 0
    dev_pages: list[np.ndarray] = []
    host_pages: list[np.ndarray] = []
    digest = host_sum = 0
    for node in nodes:
        if is_anchor(node):  # a namespace's: no pages on either tier, never queued
            check_anchor(tree, node)
            _check_tier(tree, node)
            continue
        check_node(tree, node)
        _check_tier(tree, node)
        if node.dev:
            cached += node.pages.size
            protected += node.pages.size if node.lock else 0
            dev_pages.append(node.pages)
            if node.host.size:
                copies += node.host.size
                host_sum += copy_term(node.host, node.pages)
            queued = not node.lock and not has_dev_child(node)
            _check_queued(tree.leaves, dev_live, node, queued, "device")
        else:
            _check_queued(tree.host_leaves, host_live, node, not node.children, "host")
        host += node.host.size
        host_pages.append(node.host)
        term = page_terms(node.states, node.pages)
        if term != node.term:
            raise IntegrityError(f"node {node.id}: digest term {node.term:#x} != {term:#x}")
        digest += term
    recount = (cached, protected, host, copies, host_sum & MASK)
    counters = (tree.cached_pages, tree.protected_pages, tree.host_pages, tree.copy_pages,
                tree.host_sum)  # fmt: skip
    if recount != counters:
        raise IntegrityError(
            f"tree recount (device pages, protected, host pages, copies, copy digest) = "
            f"{recount}, counters say {counters}"
        )
    _check_owned(tree.alloc, dev_pages, cached, "device")
    _check_owned(tree.host_alloc, host_pages, host, "host")
    if tree.host_alloc.count(FREE) + host != tree.host_alloc.num_pages:
        raise IntegrityError(
            f"host pool: {tree.host_alloc.count(FREE)} free + {host} cached"
            f" != {tree.host_alloc.num_pages} pages"
        )
    if digest & MASK != tree.digest_sum:
        raise IntegrityError(f"tree digest {tree.digest_sum:#x} != recomputed {digest & MASK:#x}")
    check_spaces(tree)
    c = tree.copies
    if not 0 <= c.completed <= c.started:
        raise IntegrityError(f"copies: {c.completed} completed of {c.started} started")


def _check_tier(tree: HostTreeShape, node: Any) -> None:
    if node.pinned:
        raise IntegrityError(f"node {node.id} is still pinned for a load")
    if node.dev:
        if not node.parent.dev:
            raise IntegrityError(f"device node {node.id} is under host-only node {node.parent.id}")
        if node.host.size not in (0, node.pages.size):
            raise IntegrityError(
                f"node {node.id}: a host copy of {node.host.size} pages for {node.pages.size}"
            )
        if node.pages.size and int(node.pages.max()) >= tree.offset:
            raise IntegrityError(f"device node {node.id} has a page id past the device pool")
        return
    if node.lock:
        raise IntegrityError(f"host-only node {node.id} has lock {node.lock}")
    if node.host.size != node.pages.size or not np.array_equal(node.pages, node.host + tree.offset):
        raise IntegrityError(f"host-only node {node.id}: pages are not its host pages + offset")


def _check_queued(order: Any, live: set, node: Any, candidate: bool, name: str) -> None:
    if not candidate:
        return
    k = order.key_of(node)
    if k != order.key_fn(node) or (k, node.id) not in live:
        raise IntegrityError(f"{name} candidate {node.id} is not in its eviction order")


def _check_owned(alloc: Any, pages: list[np.ndarray], total: int, name: str) -> None:
    alloc.check_integrity()
    if alloc.count(CACHED) != total:
        raise IntegrityError(
            f"{name} allocator has {alloc.count(CACHED)} cached pages, tree {total}"
        )
    flat = np.concatenate(pages) if pages else np.zeros(0, np.int64)
    if np.unique(flat).size != flat.size:
        raise IntegrityError(f"a {name} page is referenced by two tree nodes")
    if flat.size and (alloc.tags_of(flat) != CACHED).any():
        raise IntegrityError(f"a {name} tree page is not tagged cached in its allocator")
