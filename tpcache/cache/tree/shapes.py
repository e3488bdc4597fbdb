"""What the helpers of the state machine see of a tree: protocols, and the record one
eviction call fills.

The trees (``tree.RadixTree``, ``swa_tree.SwaTree``, ``host_tree.HostTree``) import
their helpers (eviction, inserts, anchors, checks, the window's and the host tier's
moves); the helpers name the tree they work on by these shapes, never by its class, so
imports run one way (trees -> helpers -> shapes) with no circle, not even a type-only
one. Each shape lists exactly the fields and calls the helpers use; the tree's class
documents them.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tpcache.cache.events import KVEvent
from tpcache.cache.host.copylog import CopyLog
from tpcache.cache.host.node import HostNode
from tpcache.cache.host.order import RunOrder
from tpcache.cache.host.pool import HostPool
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.policy.order import EvictionOrder
from tpcache.cache.policy.policies import KeyFn, PolicyHooks
from tpcache.cache.tree.hashing import PageHasher
from tpcache.cache.tree.node import Match, NodeT, SwaNode


class Freed:
    """What one ``evict`` call took; the pages go back in one free group per pool."""

    __slots__ = ("dead", "full", "swa", "tombs")

    def __init__(self) -> None:
        self.dead: list[Any] = []  # deleted nodes, in eviction order
        self.tombs: list[Any] = []  # nodes that lost only their SWA KV (a window's)
        self.full = 0  # full pages freed
        self.swa = 0  # SWA pages freed (a window's)


class TreeShape(Protocol[NodeT]):
    """``RadixTree`` as its helpers use it (fields owned by the tree; the helpers change
    them only as the tree's own steps), over nodes of class ``NodeT`` (a helper of every
    tree takes ``TreeShape[Any]``)."""

    root: NodeT
    nodes: dict[int, NodeT]
    spaces: dict[bytes, tuple[CacheNamespace, int]]
    ps: int
    alloc: Any  # a PageAllocator, or a PairedAllocator (full pool's tags)
    node_type: type[Any]  # NodeT
    window: int | None
    tick: int
    key_fn: KeyFn
    leaves: EvictionOrder
    hooks: PolicyHooks | None
    hasher: PageHasher
    record_events: bool
    medium: str
    events: list[KVEvent]
    cached_pages: int
    protected_pages: int
    digest_sum: int
    unhashed: list[NodeT]
    evict_seconds: list[float]
    evict_calls: int
    evicted_pages: int

    def new_node_id(self) -> int: ...
    def new_anchor(self, key: bytes) -> NodeT: ...
    def descend(
        self, key: np.ndarray, n: int, node: NodeT | None = None, pos: int = 0
    ) -> Match: ...
    def match_walk(self, key: np.ndarray, n: int, start: NodeT | None = None) -> Match: ...
    def split(self, child: NodeT, at: int) -> NodeT: ...
    def walk(self) -> list[NodeT]: ...
    def ensure_hashed(self) -> None: ...
    def queue_candidate(self, node: NodeT) -> None: ...
    def valid_end(self, node: NodeT) -> bool: ...
    def find_top(self, node: NodeT, mark: int) -> NodeT | None: ...
    def locks_of(self, node: NodeT) -> tuple[int, ...]: ...
    def check_window(self) -> Any: ...
    def revivable(self, path: list[NodeT], partial: NodeT | None, differ: np.ndarray) -> Any: ...
    def check_new_leaf(
        self,
        top: NodeT,
        path: list[NodeT],
        partial: NodeT | None,
        common: int,
        revive: Any,
        tail: int,
    ) -> None: ...
    def revive(self, revive: Any, path: list[NodeT], given: np.ndarray) -> None: ...
    def reprioritised(self, node: NodeT) -> None: ...
    def inserted(self, end: NodeT, tick: int, new_pages: int) -> None: ...
    def evict_window(self, num_pages: int, out: Freed) -> None: ...
    def deleted(self, node: NodeT, out: Freed) -> None: ...
    def free_evicted(self, pages: np.ndarray, out: Freed) -> None: ...
    def pool_pages(self) -> tuple[tuple[int, int], ...]: ...
    def digest_fields(self) -> tuple[int, ...]: ...
    def check_integrity(self) -> None: ...


class SwaTreeShape(TreeShape[SwaNode], Protocol):
    """``SwaTree`` as the window's eviction and checks use it."""

    window: int
    swa_key_fn: KeyFn
    swa_order: EvictionOrder
    swa_pages: int
    swa_protected: int
    tombstones: int
    tombstone_pages: int
    tombstoned_nodes: int

    def valid_end(self, node: SwaNode, acc: int = 0) -> bool: ...
    def queue_swa(self, node: SwaNode) -> None: ...


class HostTreeShape(TreeShape[HostNode], Protocol):
    """``HostTree`` as the host tier's moves and checks use it."""

    host_alloc: HostPool
    host_leaves: RunOrder
    through: int | None
    offset: int
    copies: CopyLog
    host_pages: int
    copy_pages: int
    host_sum: int
    written_pages: int
    loaded_pages: int
    host_evicted_pages: int

    def host_only_pages(self) -> int: ...
