"""Eviction from a tree, in its (full) order: unlocked leaves (alive, no lock, no child),
lowest policy key first.

Evicting a leaf deletes it and frees its pages (with a window: its SWA pages too); a
parent that becomes a leaf joins the order at once, or, if a match may not end there (a
window's rule, ``RadixTree.valid_end``), is deleted too. What one call frees goes back
to the allocator in one free group per pool. A block is announced removed when its node
is deleted. The window's own order (SWA KV) is in ``swa_evict.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tpcache.cache.allocator import CACHED
from tpcache.cache.events import BlockRemoved
from tpcache.cache.keys import join_pages
from tpcache.cache.tree.anchors import drop_anchor, is_anchor
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.node import EMPTY_PAGES, MASK, pages_of, term_of
from tpcache.cache.tree.shapes import Freed, TreeShape

if TYPE_CHECKING:
    from tpcache.cache.tree.node import Node


def evict(tree: TreeShape, num_pages: int, swa_pages: int) -> Freed:
    """``RadixTree.evict``: the full order until ``num_pages`` are freed, then the
    window's order (if ``swa_pages``), then one release; times the call."""
    started = time.perf_counter()
    out = Freed()
    pop = tree.leaves.pop
    while out.full < num_pages:
        node = pop()
        if node is None:
            break
        if not (node.lock or node.children) and node.alive:  # still an unlocked leaf
            delete(tree, node, out)
    if swa_pages:
        tree.evict_window(swa_pages, out)
    dead = out.dead
    if len(dead) == 1:  # one free group: what the tree held of the deleted nodes goes back
        pages, terms = dead[0].pages, dead[0].term
    elif dead:
        pages, terms = join_pages(map(pages_of, dead)), sum(map(term_of, dead))
    else:
        pages, terms = EMPTY_PAGES, 0
    tree.cached_pages -= pages.size
    tree.digest_sum = (tree.digest_sum - terms) & MASK
    if tree.window is None:
        if dead:
            tree.alloc.free(pages, CACHED, checked=False)
    else:
        tree.free_evicted(pages, out)
    if dead and tree.hooks is not None:
        tree.hooks.on_evict(dead)
    return record_evict(tree, out, started)


def record_evict(tree: TreeShape, out: Freed, started: float) -> Freed:
    """Count an eviction call that freed ``out`` and keep its time (the last 10-20k)."""
    tree.evicted_pages += out.full
    tree.evict_calls += 1
    seconds = tree.evict_seconds
    seconds.append(time.perf_counter() - started)
    if len(seconds) > 20_000:
        del seconds[:10_000]
    return out


def delete(tree: TreeShape, node: Node, out: Freed) -> None:
    """Delete unlocked leaf ``node`` into ``out``; then its parent if it became a leaf
    that may not end a match, and so on up."""
    pb, root, nodes, dead = 4 * tree.ps, tree.root, tree.nodes, out.dead
    while True:
        parent = node.parent
        del parent.children[node.kb[:pb]]
        del nodes[node.id]
        node.alive = False
        dead.append(node)
        out.full += node.pages.size
        if tree.window is not None:
            tree.deleted(node, out)
        # A tombstone's blocks were announced removed when its sliding-window KV went.
        if tree.record_events and not getattr(node, "tombstone", False):
            tree.events.append(
                BlockRemoved(block_hashes=block_hashes(node.states).tolist(), medium=tree.medium)
            )
        if parent is root or parent.children:
            return
        if is_anchor(parent):  # a namespace's anchor lost its last child: it goes too
            drop_anchor(tree, parent)
            return
        if tree.window is None or tree.valid_end(parent):
            tree.queue_candidate(parent)
            return
        node = parent
        assert node.lock == 0, f"node {node.id}, an invalid match end, is locked"
