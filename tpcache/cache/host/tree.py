"""The radix tree with a host (CPU) tier: each node's pages are on the device, on the
host, or both.

A node keeps its device pages in ``pages`` and its host copy in ``host``. A node on the
host only keeps ``host + offset`` in ``pages`` (``offset``: the device pool's size), so
every length, split and block hash of the base tree still holds, and the digest term of
a node tells the tiers apart. Why one tree and not two: a match walks one path, and the
device part of a cached prefix is always its leading part (the device tier is closed
under parents: a node moves to the host only when no child is on the device, and a
load or an insert revives host nodes top-down), so a match is the device prefix and the
host prefix beyond it.

Two eviction orders, both the cache's policy: ``leaves`` (device nodes with no lock and
no device child: what an eviction moves off the device) and ``host_leaves`` (host-only
nodes with no child: what a full host pool drops). Both are ``RunOrder``s
(``host_order.py``). The moves are in ``host_moves.py`` (eviction from the device:
``host_evict.py``), the full walk of ``check_integrity`` in ``host_check.py``.

Copies: every move between the tiers is a copy started in ``copies`` (ids in order).
The tree's decisions never wait for a copy: a page leaves a node (is freed, or given to
another node or request) in the call that moves it, and what makes that safe is the
order copies run in and who may touch a page before they are done (``host_cache.py``:
a request's forward waits until the copies started before its admit or extend are
done). In one process a copy completes as it starts; in a lockstep (``defer``) the
completed count moves only by ``CopyWaits.done(n)``, with the count the ranks agreed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tpcache.cache.errors import LockError
from tpcache.cache.host.check import check_host_tree
from tpcache.cache.host.copylog import CopyLog
from tpcache.cache.host.evict import evict_device
from tpcache.cache.host.moves import has_dev_child, write_to_host
from tpcache.cache.host.node import HostNode
from tpcache.cache.host.order import RunOrder
from tpcache.cache.policy.policies import KeyFn
from tpcache.cache.tree.shapes import Freed
from tpcache.cache.tree.tree import RadixTree


class TierCut(NamedTuple):
    """A match cut where its device prefix ends: the device part (as ``node.Match``),
    then the host-only nodes beyond it, matched whole, and the host-only node where the
    match stops part-way with its common tokens."""

    path: list[HostNode]
    pos: int
    partial: HostNode | None
    common: int
    hosts: list[HostNode]
    host_partial: HostNode | None
    host_common: int


class HostTree(RadixTree[HostNode]):
    """``RadixTree`` over a device pool (``alloc``) and a host pool (``host_alloc``).

    Owned here: the host allocator's tags (host pages are CACHED while a node holds
    them), ``host_leaves``, the host counters and ``copies``. ``through``: hits that
    copy a node to the host (write-through-selective), ``None`` for write-back.
    """

    node_type = HostNode

    def __init__(
        self,
        alloc: Any,
        key_fn: KeyFn,
        host_alloc: Any,
        through: int | None,
        *,
        record_events: bool = False,
        record_copies: bool = False,
        defer_copies: bool = False,
        medium: str = "GPU",
    ) -> None:
        self.host_alloc = host_alloc
        self.through = through
        self.offset = alloc.num_pages  # host-only nodes' pages: host id + offset
        self.copies = CopyLog(record_copies, defer_copies, alloc.num_pages)
        # Statistics since creation (reset included): pages written, loaded, and dropped
        # from the host pool by its eviction.
        self.written_pages = self.loaded_pages = self.host_evicted_pages = 0
        super().__init__(alloc, key_fn, record_events=record_events, medium=medium)

    def clear(self) -> None:
        super().clear()
        self.leaves = RunOrder(self.key_fn)  # (the base tree's order, in runs)
        self.host_alloc.reset()
        self.host_leaves = RunOrder(self.key_fn)  # host-only nodes without children
        self.host_pages = 0  # host pages the tree holds (host-only nodes and copies)
        self.copy_pages = 0  # of them, copies of device-resident nodes
        self.host_sum = 0  # digest of the copies: each host page with its device page

    # ---- the base tree's hooks and overrides --------------------------------------------
    def split(self, child: HostNode, at: int) -> HostNode:
        upper = super().split(child, at)
        upper.dev = child.dev
        upper.pinned = child.pinned
        host = child.host
        if not child.dev:  # host-only: pages are host + offset
            upper.host = upper.pages - self.offset
            child.host = child.pages - self.offset
        elif host.size:
            cut = at // self.ps
            upper.host = host[:cut].copy()
            child.host = host[cut:].copy()
        return upper

    def queue_candidate(self, node: HostNode) -> None:
        # A device candidate: no lock and no child on the device (host children do not
        # hold it: they go down with it or stay below it on the host).
        dev = node.dev
        if dev and not node.lock and node.alive and not (node.children and has_dev_child(node)):
            self.leaves.push(node)

    def unlock(self, node: HostNode, top: HostNode | None = None) -> None:
        if node is self.root:
            return
        if node.lock <= 0:
            raise LockError(f"node {node.id} is not locked")
        node.lock -= 1
        if node.lock == 0:
            self.protected_pages -= node.pages.size
            if not (node.children and has_dev_child(node)):  # a device candidate now
                self.leaves.push(node)
        # Above it, each node has a device child (the one the walk came from: it was
        # locked, so it is on the device), so none becomes a candidate.
        root = self.root
        node = node.parent  # type: ignore[assignment]
        while node is not root:
            node.lock -= 1
            if node.lock == 0:
                self.protected_pages -= node.pages.size
            node = node.parent  # type: ignore[assignment]

    def check_lockable(self, node: HostNode, top: HostNode | None) -> None:
        if not node.dev:
            raise LockError(f"node {node.id} moved to the host since the match; match again")

    def touch(self, path: list[HostNode], queue: bool = True) -> None:
        super().touch(path, queue)
        hits = self.through
        if hits is not None:
            for node in path:
                if node.hits >= hits and not node.host.size:
                    write_to_host(self, node)

    def evict(self, num_pages: int, swa_pages: int = 0) -> Freed:
        """Move ``num_pages`` device pages off the device in policy order (to the host, or
        dropped); ``Freed.dead`` lists every node that left the device."""
        return evict_device(self, num_pages)

    def digest_fields(self) -> tuple[int, ...]:
        c = self.copies
        return (*self.host_alloc.fingerprint(), self.host_pages, self.copy_pages, self.host_sum,
                c.started, c.completed)  # fmt: skip

    def check_integrity(self) -> None:
        check_host_tree(self)

    # ---- the host walk ------------------------------------------------------------------
    def tier_cut(
        self, path: list[HostNode], pos: int, partial: HostNode | None, common: int
    ) -> TierCut:
        """A ``descend`` result cut where the device prefix ends."""
        if path and not path[-1].dev:  # (else all are: the device tier is closed under parents)
            i = next(i for i, node in enumerate(path) if not node.dev)
            dpos = pos - sum(len(n.kb) for n in path[i:]) // 4
            return TierCut(path[:i], dpos, None, 0, path[i:], partial, common)
        if partial is not None and not partial.dev:
            return TierCut(path, pos, None, 0, [], partial, common)
        return TierCut(path, pos, partial, common, [], None, 0)

    def host_only_pages(self) -> int:
        return self.host_pages - self.copy_pages
