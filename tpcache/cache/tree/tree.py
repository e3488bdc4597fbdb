"""The paged radix tree: cached prefixes, their pages, locks and the eviction order.

Each node holds a run of whole pages: its tokens (the bytes of int32 ids), its page ids
(int64, one per page) and the chain state of each page's block hash (uint64). Children
are keyed by the bytes of their first page, so a lookup costs one dict probe per node
and a comparison is one ``memcmp`` per node (``bytes.startswith`` on a memoryview of
the query), never a Python step per token and no numpy call per node.

Eviction candidates (unlocked leaves) sit in an ``EvictionOrder`` (a lazy heap ordered
by the policy key): evicting k nodes costs O(k log n).

This is the one tree. The sliding window (``swa_tree.SwaTree``) extends it through the
hooks marked below (a lock's window, match ends, revival, a second eviction order); here
they do nothing, as for a cache without SWA KV; the window's locks and anchors are
``SwaTree``'s overrides. The node and the lookup walk are in
``node.py``, the full walk of ``check_integrity`` in ``tree_check.py``. This module is
internal: the caches are the public face and hand out opaque handles, never nodes.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np

from tpcache.cache.errors import LockError
from tpcache.cache.events import KVEvent
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.policy.order import EvictionOrder
from tpcache.cache.policy.policies import KeyFn, PolicyHooks
from tpcache.cache.records import CacheStats
from tpcache.cache.tree.anchors import BASE_LOCK
from tpcache.cache.tree.check import check_tree
from tpcache.cache.tree.evict import evict
from tpcache.cache.tree.hashing import PageHasher
from tpcache.cache.tree.node import (
    EMPTY_PAGES,
    EMPTY_STATES,
    Match,
    Node,
    descend,
    hash_pending,
    split_node,
)
from tpcache.cache.tree.shapes import Freed

__all__ = ["Freed", "Node", "RadixTree"]

N = TypeVar("N", bound=Node)  # a tree's node class: ``Node``, or a kind's that adds fields


class RadixTree(Generic[N]):
    """Radix tree over whole pages, with locks, a policy-ordered eviction queue and events.

    The tree owns its nodes and counters; the allocator owns page tags. Pages enter the
    tree from HELD (a request's) or LENT (a caller's) and leave it to FREE (eviction).
    ``tick`` is the logical clock.
    """

    node_type: type[Any] = Node  # the class of its nodes (``N``; a kind's tree sets its own)
    window: int | None = None  # tokens a lock keeps SWA KV for; None: no SWA pool
    tombstoned_nodes = 0  # nodes that lost their SWA KV (none without a window)

    def __init__(
        self,
        alloc: Any,
        key_fn: KeyFn,
        *,
        record_events: bool = False,
        medium: str = "GPU",
        hooks: PolicyHooks | None = None,
    ) -> None:
        self.alloc = alloc  # a PageAllocator (or PairedAllocator: the full pool's tags)
        self.ps = alloc.page_size
        self.key_fn = key_fn
        # A stateful policy's state, told of every match, new leaf, eviction and clear.
        self.hooks = hooks
        if hooks is not None:
            hooks.attach(self)
        self.hasher = PageHasher(self.ps)
        self.record_events = record_events
        self.medium = medium
        self.events: list[KVEvent] = []
        # Statistics only (wall time never decides anything): per-evict-call seconds, kept
        # for the last 10,000 calls at least; calls and pages evicted since creation.
        self.evict_seconds: list[float] = []
        self.evict_calls = 0
        self.evicted_pages = 0
        # Node ids only grow, across reset() too, so a handle from before a reset can
        # never name a node created after it.
        self._next_id = 1
        self.clear()

    def clear(self) -> None:
        self.root: N = self.node_type(0, None, b"", EMPTY_PAGES, EMPTY_STATES, 0)
        self.root.lock = 1  # the root is never evicted
        self.nodes: dict[int, N] = {0: self.root}
        self.tick = 0
        self.cached_pages = 0  # pages in the tree
        self.protected_pages = 0  # pages of nodes with lock > 0
        self.digest_sum = 0
        # Namespaces with an anchor (``anchors.py``), by anchor key: the namespace and its
        # chain seed. An anchor lives exactly while it has children.
        self.spaces: dict[bytes, tuple[CacheNamespace, int]] = {}
        # Nodes whose block hashes are not computed yet (see ``ensure_hashed``): the
        # tree's, appended and drained by the hashing walks of ``node.py``.
        self.unhashed: list[N] = []
        self.leaves = EvictionOrder(self.key_fn)  # the unlocked leaves
        if self.hooks is not None:
            self.hooks.reset()

    def new_node_id(self) -> int:
        """A fresh node id: ids only grow, across ``clear`` too."""
        node_id = self._next_id
        self._next_id = node_id + 1
        return node_id

    @property
    def next_node_id(self) -> int:
        """The id the next new node gets (read-only)."""
        return self._next_id

    # ---- lookup -------------------------------------------------------------------------
    def descend(self, key: np.ndarray, n: int, node: N | None = None, pos: int = 0) -> Match:
        """Walk ``key[:n]`` (page-aligned) without changing anything.

        Starts at the root, or at ``node`` that is known to end at ``key[:pos]``.
        Returns the fully matched nodes after the start, the tokens matched up to the
        last of them, and the node where the match stops part-way with its matched
        token count (``None, 0`` if none). ``key`` is a C-contiguous int32 array.
        """
        return descend(self.root if node is None else node, self.ps, key, n, pos)

    def match_walk(self, key: np.ndarray, n: int, start: N | None = None) -> Match:
        """``descend`` from the root (or a namespace's anchor ``start``), cut back to where
        a match may end (hook: every point here; a window needs SWA KV before the end).
        Changes nothing."""
        return descend(start or self.root, self.ps, key, n, 0)

    def split(self, child: N, at: int) -> N:
        """Cut ``child`` after ``at`` tokens (whole pages); returns the new upper node
        (``node.split_node``)."""
        return split_node(self, child, at)

    def split_match(
        self, path: list[N], pos: int, partial: N | None, common: int
    ) -> tuple[list[N], int]:
        """Make a ``descend`` result a match: split the partial node, append its upper half."""
        if partial is not None:
            path.append(self.split(partial, common))
            pos += common
        return path, pos

    def touch(self, path: list[N], queue: bool = True) -> None:
        """A match used ``path``: advance the clock, count a hit on each node, requeue its
        end (``queue=False``: a lock was just taken on it, so it is no candidate)."""
        self.tick += 1
        tick = self.tick
        if self.hooks is not None:
            self.hooks.on_match(path, tick)
        for node in path:
            node.last_access = tick
            node.hits += 1
        if path and queue:
            self.queue_candidate(path[-1])

    def ensure_hashed(self) -> None:
        """Compute the block hashes (and digest terms) of every node that lacks them.

        Hashing is deferred until a digest, the events or a check needs it: a cache whose
        digest nobody asks for (a single-process replay) never pays for it. Each node is
        hashed once, parents first, so the total cost is the same as hashing at insert.
        """
        hash_pending(self)

    # ---- locks --------------------------------------------------------------------------
    def lock(self, node: N, top: N | None = None) -> None:
        """Protect ``node`` and its ancestors from eviction (counts nest). ``top`` (a
        ``boundary``) is the window's: ``SwaTree`` locks its SWA KV too; none here."""
        root = self.root
        while node is not root:
            if node.lock == 0:
                self.protected_pages += node.pages.size
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: N, top: N | None = None) -> None:
        """Undo one ``lock(node, top)``; raises ``LockError`` (changing nothing) if
        ``node`` is not locked."""
        if node is self.root:
            return
        if node.lock <= 0:
            raise LockError(f"node {node.id} is not locked")
        root = self.root
        while node is not root:
            node.lock -= 1
            if node.lock == 0:
                self.protected_pages -= node.pages.size
                if not node.children:
                    self.leaves.push(node)  # now an unlocked leaf (alive: it was locked)
            node = node.parent  # type: ignore[assignment]

    def new_anchor(self, key: bytes) -> N:
        """A namespace's anchor under the root, registered (``anchors.anchor_of``): no
        pages, only its base lock."""
        node = self.node_type(
            self.new_node_id(), self.root, key, EMPTY_PAGES, EMPTY_STATES, self.tick
        )
        node.lock = BASE_LOCK
        self.root.children[key] = node
        self.nodes[node.id] = node
        return node

    # ---- hooks of the sliding window (SwaTree); without one they do nothing, and the hot
    # paths (locks, inserts, evictions) skip them unless ``window`` (or a ``top``) is set.
    def boundary(self, node: N) -> N | None:
        """Where a lock ending at ``node`` stops keeping SWA KV."""
        return None

    def mark_of(self, top: N | None) -> int:
        """The boundary mark a handle or request keeps for ``top`` (0: none)."""
        return 0

    def find_top(self, node: N, mark: int) -> N | None:
        """The boundary named by ``mark`` on ``node``'s path."""
        return None

    def check_lockable(self, node: N, top: N | None) -> None:
        """Raise ``LockError`` if ``lock(node, top)`` would lock KV that is gone."""

    def valid_end(self, node: N) -> bool:
        """May a match end at ``node``'s end?"""
        return True

    def revivable(self, path: list[N], partial: N | None, differ: np.ndarray) -> Any:
        """What an insert over ``path`` revives (``None``: nothing)."""
        return None

    def check_new_leaf(
        self,
        top: N,
        path: list[N],
        partial: N | None,
        common: int,
        revive: Any,
        tail: int,
    ) -> None:
        """Raise ``InvalidSlots`` if an insert's new leaf of ``tail`` tokens after ``top``,
        ``path`` and ``common`` tokens of ``partial`` could never be matched."""

    def revive(self, revive: Any, path: list[N], given: np.ndarray) -> None:
        """Revive what ``revivable`` found, with the given pages of the walked part."""

    def reprioritised(self, node: N) -> None:
        """``node``'s priority was raised by an insert."""

    def inserted(self, end: N, tick: int, new_pages: int) -> None:
        """An insert ended at ``end`` at ``tick``, adding ``new_pages`` (a new leaf's)."""

    def evict_window(self, num_pages: int, out: Freed) -> None:
        """The second eviction order (SWA KV) frees ``num_pages`` more."""

    def deleted(self, node: N, out: Freed) -> None:
        """``node`` was deleted by an eviction."""

    def free_evicted(self, pages: np.ndarray, out: Freed) -> None:
        """Return what an eviction took to the allocator (the deleted nodes' ``pages``,
        and what the window's order freed)."""

    # ---- eviction -----------------------------------------------------------------------
    def queue_candidate(self, node: N) -> None:
        if not (node.lock or node.children) and node.alive:  # an unlocked leaf
            self.leaves.push(node)

    def rekey(self) -> None:
        """Recompute every candidate's key: a stateful policy's key function changed."""
        self.leaves.rekey()

    def evict(self, num_pages: int, swa_pages: int = 0) -> Freed:
        """Evict unlocked leaves in policy order until ``num_pages`` are freed or none is
        left; then, with a window, SWA KV until ``swa_pages`` SWA pages are freed
        (counting what the first phase freed). Frees one group per pool (``evict.py``)."""
        return evict(self, num_pages, swa_pages)

    # ---- per-pool views -----------------------------------------------------------------
    def pool_pages(self) -> tuple[tuple[int, int], ...]:
        """(cached, protected) pages per pool."""
        return ((self.cached_pages, self.protected_pages),)

    def evictable_after_lock(
        self, path: list[N], partial: N | None, common: int
    ) -> tuple[int, ...]:
        """Pages per pool eviction could free once the match ``path`` (and ``common``
        tokens of ``partial``) is locked: its pages are not evictable then."""
        pinned = sum(p.pages.size for p in path if p.lock == 0)
        if partial is not None and partial.lock == 0:
            pinned += common // self.ps
        return (self.cached_pages - self.protected_pages - pinned,)

    def digest_fields(self) -> tuple[int, ...]:
        """Counters the cache digest covers beyond the full pool's."""
        return ()

    def evicted(self) -> tuple[int, ...]:
        """Pages evicted per pool since creation."""
        return (self.evicted_pages,)

    def stats(self) -> CacheStats:
        return CacheStats(self.evict_calls, self.evicted(), self.tombstoned_nodes)

    def locks_of(self, node: N) -> tuple[int, ...]:
        """A node's lock counts per pool."""
        return (node.lock,)

    def check_window(self) -> Any:
        """The window's part of ``check_integrity`` (``swa_check.WindowCheck``); none here."""
        return None

    # ---- whole-tree views -----------------------------------------------------------------
    def walk(self) -> list[N]:
        """Every node but the root, parents before children, children in key order."""
        out: list[N] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out

    def check_integrity(self) -> None:
        """Walk the whole tree and recount; raise ``IntegrityError`` naming what broke."""
        check_tree(self)
