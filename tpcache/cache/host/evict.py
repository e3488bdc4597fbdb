"""Eviction from the tiered tree's device tier: device candidates (``HostTree.leaves``)
in policy order. A node with a host copy becomes host-only; under write-back one without
is written to the host first (its host pages taken in one allocation per run of
write-backs: ``_Writes``); one that finds no host room is deleted with its host-only
subtree. The moves themselves are ``host_moves.py``'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import CACHED
from tpcache.cache.host.moves import (
    announce,
    copy_term,
    count_written,
    drop_subtree,
    has_dev_child,
    retier,
    started_write,
    take_host,
)
from tpcache.cache.keys import join_pages
from tpcache.cache.tree.evict import record_evict
from tpcache.cache.tree.node import MASK
from tpcache.cache.tree.shapes import Freed

if TYPE_CHECKING:
    from tpcache.cache.tree.shapes import HostTreeShape


class _Writes:
    """The write-backs of one eviction that took host pages from the free FIFO, kept back
    so that they take them in one ``alloc`` (the pages, the FIFO and the tags end the same
    as node-by-node allocs: no free comes between them). Flushed, in order, before any
    other host-pool move of the eviction and at its end; a node in it is host-only
    already except for its ``host`` and ``pages`` and its copy, started at the flush."""

    __slots__ = ("devices", "nodes", "pages")

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.devices: list[np.ndarray] = []  # each node's device pages
        self.pages = 0

    def flush(self, tree: HostTreeShape) -> None:
        if not self.pages:
            return
        host = tree.host_alloc.alloc(self.pages, CACHED)
        shifted = host + tree.offset
        copies = tree.copies
        start = None if copies.counts_only else copies.start
        k = 0
        for node, device in zip(self.nodes, self.devices, strict=True):
            n = device.size
            node.host = host[k : k + n]
            if start is not None:
                start(True, device, node.host)
            if node.states is None:  # (``retier``, inline: an unhashed node has no term)
                node.pages = shifted[k : k + n]
            else:
                retier(tree, node, shifted[k : k + n])
            k += n
        if start is None:
            copies.started_many(len(self.nodes))
        self.nodes.clear()  # (cleared, not replaced: ``evict_device`` holds the lists)
        self.devices.clear()
        self.pages = 0


def evict_device(tree: HostTreeShape, num_pages: int) -> Freed:
    """``HostTree.evict``: device candidates in policy order until ``num_pages`` device
    pages are freed or none is left; the pages go back in one free group. Times the call.

    The common move, a write-back with no copy yet into free host pages and no events to
    announce, is ``_leave_device``'s, inline (most moves are it)."""
    started = time.perf_counter()
    out = Freed()
    dead = out.dead
    freed: list[np.ndarray] = []
    writes = _Writes()
    queued, devices = writes.nodes, writes.devices
    pop, push = tree.leaves.pop, tree.leaves.push
    host_push = tree.host_leaves.push
    host_alloc = tree.host_alloc
    plain = tree.through is None and not tree.record_events
    while out.full < num_pages and (node := pop()) is not None:
        if not node.dev or node.lock or not node.alive or (node.children and has_dev_child(node)):
            continue
        pages = node.pages
        n = pages.size
        if plain and not node.host.size and host_alloc.num_free - writes.pages >= n:
            out.full += n
            dead.append(node)
            freed.append(pages)
            queued.append(node)
            devices.append(pages)
            writes.pages += n
            tree.cached_pages -= n
            tree.host_pages += n
            tree.written_pages += n
            node.dev = False
            if not node.children:
                host_push(node)
            parent = node.parent  # a device candidate now? (``HostTree.queue_candidate``, inline)
            if parent.dev and not parent.lock and parent.alive and not has_dev_child(parent):
                push(parent)
        else:
            _leave_device(tree, node, out, freed, writes)
    writes.flush(tree)
    if freed:
        pages = freed[0] if len(freed) == 1 else join_pages(freed)
        tree.alloc.free(pages, CACHED, checked=False)
    return record_evict(tree, out, started)


def _leave_device(
    tree: HostTreeShape, node: Any, out: Freed, freed: list[np.ndarray], writes: _Writes
) -> None:
    n = node.pages.size
    out.full += n
    out.dead.append(node)
    freed.append(node.pages)
    tree.cached_pages -= n
    if node.host.size:  # a copy already (write-through): only the device's pages go
        tree.copy_pages -= n
        tree.host_sum = (tree.host_sum - copy_term(node.host, node.pages)) & MASK
        moved = True
    elif tree.through is not None:
        moved = False
    elif tree.host_alloc.num_free - writes.pages >= n:  # write-back from the free FIFO
        # The node goes straight to host-only (never counted in ``copy_pages``): its
        # device pages leave it now, and whoever gets them next waits for the copy.
        writes.nodes.append(node)
        writes.devices.append(node.pages)
        writes.pages += n
        count_written(tree, node, n)
        moved = True
    else:  # write-back, if the host can drop enough for it
        if writes.pages:
            writes.flush(tree)
        host = take_host(tree, n)
        moved = host is not None
        if moved:
            started_write(tree, node, host)
    if moved:
        if tree.record_events:
            announce(tree, node, tree.medium, stored=False)
        if node.host.size:  # (a node in ``writes`` gets its pages at the flush)
            retier(tree, node, node.host + tree.offset)
        node.dev = False
        if not node.children:
            tree.host_leaves.push(node)
    else:
        drop_subtree(tree, node)
    parent = node.parent  # a device candidate now? (``HostTree.queue_candidate``, inline)
    if parent.dev and not parent.lock and parent.alive and not has_dev_child(parent):
        tree.leaves.push(parent)
