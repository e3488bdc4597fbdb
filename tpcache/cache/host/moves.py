"""The moves of the host tier: what leaves the device, what the host pool drops, what a
load or an insert brings back.

- ``evict_device`` (``host_evict.py``): device candidates in policy order leave the
  device, by the moves here (``write_to_host``'s pages, ``drop_subtree``).
- ``_drop_host_leaves``: host-only leaves (``HostTree.host_leaves``) in policy order are
  deleted until the pages fit (pinned ones, being loaded, are skipped).
- ``to_device``: a host-only node gets device pages (a load, or the pages of a request
  that computed the same tokens: an insert over it); write-back frees the host copy
  then (exclusive tiers), write-through keeps it.

Every move keeps the tree's counters, the digest terms (a node's term covers its
``pages``, which change tier) and the KV events (a store and a removal per medium).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import CACHED, HELD
from tpcache.cache.events import BlockRemoved, stored_event
from tpcache.cache.host.config import HOST
from tpcache.cache.keys import join_pages
from tpcache.cache.namespace import is_anchor
from tpcache.cache.tree.anchors import drop_anchor, namespace_of
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.node import EMPTY_PAGES, MASK, page_terms

if TYPE_CHECKING:
    from tpcache.cache.tree.shapes import HostTreeShape

_K2 = 0x9E3779B97F4A7C15  # odd


def has_dev_child(node: Any) -> bool:
    # A loop, not any(): a generator costs more than the few children it checks.
    for child in node.children.values():  # noqa: SIM110
        if child.dev:
            return True
    return False


def copy_term(host: np.ndarray, device: np.ndarray) -> int:
    """Digest term of a node's host copy: each host page paired with its device page."""
    h = host.view(np.uint64) + np.uint64(_K2)
    d = device.view(np.uint64) + np.uint64(_K2 >> 1)
    return int(np.add.reduce(h * d)) & MASK


def retier(tree: HostTreeShape, node: Any, pages: np.ndarray) -> None:
    """Give ``node`` new ``pages`` (its tier changed): its digest term follows if it is
    hashed (an unhashed node is hashed later, from the pages it has then)."""
    if node.states is not None:
        term = page_terms(node.states, pages)
        tree.digest_sum = (tree.digest_sum - node.term + term) & MASK
        node.term = term
    node.pages = pages


def announce(tree: HostTreeShape, node: Any, medium: str, stored: bool) -> None:
    # Callers on the hot paths check ``record_events`` first: a call per move costs.
    if not tree.record_events:
        return
    hashes = block_hashes(node.states).tolist()
    if not stored:
        tree.events.append(BlockRemoved(block_hashes=hashes, medium=medium))
        return
    parent = node.parent
    parent_hash = int(block_hashes(parent.states[-1:])[0]) if parent.states.size else None
    space = namespace_of(tree, parent)
    tree.events.append(stored_event(hashes, parent_hash, node.key.tolist(), tree.ps, medium, space))


# ---- device -> host ---------------------------------------------------------------------
def take_host(tree: HostTreeShape, n: int) -> np.ndarray | None:
    """``n`` host pages for a copy, by host eviction if needed; None if they cannot be had."""
    alloc = tree.host_alloc
    if alloc.num_free >= n:
        return alloc.alloc(n, CACHED)
    freed = _drop_host_leaves(tree, n)
    if freed is None:
        return None
    return alloc.recycle(freed, CACHED, n, CACHED)  # (the dropped nodes' pages: theirs to sort)


def started_write(tree: HostTreeShape, node: Any, host: np.ndarray) -> None:
    node.host = host
    tree.copies.start(True, node.pages, host)
    count_written(tree, node, host.size)


def count_written(tree: HostTreeShape, node: Any, n: int) -> None:
    tree.host_pages += n
    tree.written_pages += n
    if tree.record_events:
        announce(tree, node, HOST, stored=True)


def write_to_host(tree: HostTreeShape, node: Any) -> bool:
    """Copy device node ``node`` to the host (it keeps its device pages: write-through):
    host pages for it, by host eviction if needed. False, and nothing copied, if they
    cannot be had."""
    host = take_host(tree, node.pages.size)
    if host is None:
        return False
    started_write(tree, node, host)
    tree.copy_pages += host.size
    tree.host_sum = (tree.host_sum + copy_term(host, node.pages)) & MASK
    return True


def drop_subtree(tree: HostTreeShape, node: Any) -> None:
    """Delete device node ``node`` (its device pages are the caller's to free) and its
    descendants, all host-only (the device tier is closed under parents)."""
    stack = list(node.children.values())
    while stack:
        child = stack.pop()
        stack.extend(child.children.values())
        _delete(tree, child)
        tree.host_alloc.free(child.host, CACHED, checked=False)
        tree.host_pages -= child.host.size
        tree.host_evicted_pages += child.host.size
        tree.host_leaves.forget(child)
        announce(tree, child, HOST, stored=False)
    _delete(tree, node)
    announce(tree, node, tree.medium, stored=False)
    _drop_empty_anchor(tree, node.parent)


def _drop_empty_anchor(tree: HostTreeShape, node: Any) -> None:
    """A namespace's anchor that just lost its last child goes too (``anchors.py``)."""
    if not node.children and is_anchor(node):
        drop_anchor(tree, node)


def _delete(tree: HostTreeShape, node: Any) -> None:
    del node.parent.children[node.kb[: 4 * tree.ps]]
    del tree.nodes[node.id]
    node.alive = False
    tree.digest_sum = (tree.digest_sum - node.term) & MASK
    # A dead node may stay referenced a while (stale heap entries, the tree's list of
    # nodes to hash), and its tokens are most of its memory: let them go now, so that
    # new nodes reuse that memory instead of growing the heap.
    node.kb = b""


# ---- the host pool ----------------------------------------------------------------------
def _drop_host_leaves(tree: HostTreeShape, n: int) -> np.ndarray | None:
    """Delete host-only leaves in policy order until ``n`` host pages would be free; the
    pages they held (the caller frees them, one group), or None if ``n`` cannot be freed
    (nothing deleted then). Pinned leaves (being loaded) are skipped."""
    alloc = tree.host_alloc
    have = alloc.num_free
    if n > have + tree.host_only_pages():
        return None
    pop = tree.host_leaves.pop
    events = tree.record_events
    nodes, pb = tree.nodes, 4 * tree.ps
    skipped = []
    freed = []
    while have < n:
        node = pop()
        if node is None:
            break
        if node.dev or node.children or not node.alive:
            continue
        if node.pinned:
            skipped.append(node)
            continue
        del node.parent.children[node.kb[:pb]]  # (``_delete``, inline)
        del nodes[node.id]
        node.alive = False
        tree.digest_sum = (tree.digest_sum - node.term) & MASK
        node.kb = b""
        host = node.host
        freed.append(host)
        have += host.size
        if events:
            announce(tree, node, HOST, stored=False)
        parent = node.parent
        if not (parent.dev or parent.children):
            tree.host_leaves.push(parent)
        else:  # (an anchor is "on the device")
            _drop_empty_anchor(tree, parent)
    for node in skipped:
        tree.host_leaves.push(node)
    if not freed:
        return None if have < n else np.zeros(0, np.int64)
    pages = freed[0] if len(freed) == 1 else join_pages(freed)
    tree.host_pages -= pages.size
    tree.host_evicted_pages += pages.size
    if have < n:  # what was deleted stays deleted, as in any eviction
        alloc.free(pages, CACHED, checked=False)
        return None
    return pages


# ---- host -> device ---------------------------------------------------------------------
def to_device(tree: HostTreeShape, node: Any, pages: np.ndarray, owner: int) -> None:
    """Host-only ``node`` gets the device ``pages`` (tagged ``owner`` until now) of a
    request that computed the same tokens (an insert over it). Its parent is on the
    device already (callers go top-down)."""
    pages = pages.copy()  # the node's own array from now on
    tree.alloc.retag(pages, owner, CACHED, checked=False)
    _on_device(tree, node, pages, False)
    tree.queue_candidate(node)


def load(tree: HostTreeShape, hosts: list[Any], pages: np.ndarray) -> int:
    """Load the host-only path ``hosts`` (top-down, pinned by an admit) into the first of
    ``pages`` (HELD); a copy is started for each node. Returns the pages they took. None
    is queued for eviction: the caller locks the last one at once."""
    n = sum([h.pages.size for h in hosts])
    own = pages[:n].copy()  # the nodes' own arrays from now on (one copy, cut)
    tree.alloc.retag(own, HELD, CACHED, checked=False)
    if tree.through is None and not tree.record_events and tree.copies.counts_only:
        _load_plain(tree, hosts, own)
        return n
    frees: list[np.ndarray] | None = [] if tree.through is None else None
    k = 0
    for h in hosts:
        m = h.pages.size
        _on_device(tree, h, own[k : k + m], True, frees)
        h.pinned = False
        k += m
    if frees:  # each node's host copy its own free group, in order, as one call
        tree.host_alloc.free_groups(frees)
    return n


def _load_plain(tree: HostTreeShape, hosts: list[Any], own: np.ndarray) -> None:
    """``load``'s nodes under write-back, with no events and no copy kept: each node as
    ``_on_device`` does it, the counters once."""
    forget = tree.host_leaves.forget
    frees = []
    k = 0
    for h in hosts:
        m = h.pages.size
        pages = own[k : k + m]
        if h.states is None:  # (``retier``, inline: an unhashed node has no term)
            h.pages = pages
        else:
            retier(tree, h, pages)
        h.dev = True
        forget(h)
        frees.append(h.host)
        h.host = EMPTY_PAGES
        h.pinned = False
        k += m
    tree.copies.started_many(len(hosts))
    tree.loaded_pages += k
    tree.cached_pages += k
    tree.host_pages -= k
    tree.host_alloc.free_groups(frees)  # each node's host copy its own free group, in order


def _on_device(
    tree: HostTreeShape, node: Any, pages: np.ndarray, loaded: bool, frees: list | None = None
) -> None:
    """Host-only ``node`` is on the device in ``pages`` (the tree's already): its copy
    starts if ``loaded``; write-back frees the host copy then (exclusive tiers; copies run
    in id order, so whoever gets the host pages next writes them after the load read
    them), write-through keeps it. ``frees``: where write-back leaves the host copy for
    the caller to free (else it is freed here)."""
    n = pages.size
    if loaded:
        tree.copies.start(False, pages, node.host)
        tree.loaded_pages += n
    retier(tree, node, pages)
    node.dev = True
    tree.cached_pages += n
    tree.host_leaves.forget(node)
    events = tree.record_events
    if events:
        announce(tree, node, tree.medium, stored=True)
    if tree.through is None:
        if frees is None:
            tree.host_alloc.free(node.host, CACHED, checked=False)
        else:
            frees.append(node.host)
        tree.host_pages -= n
        node.host = EMPTY_PAGES
        if events:
            announce(tree, node, HOST, stored=False)
    else:
        tree.copy_pages += n
        tree.host_sum = (tree.host_sum + copy_term(node.host, pages)) & MASK
