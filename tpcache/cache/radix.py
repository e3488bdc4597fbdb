"""``RadixCache``: the one-pool cache (full-attention models), the state machine every TP
rank and the coordinator run.

It is ``PrefixCache`` (``prefix.py``: the request lifecycle and the tree-level calls)
over a ``PageAllocator`` and a ``RadixTree`` with the configured eviction policy. The
same op sequence gives the same tree, the same slot ids and the same digest in every
process; every public method validates its input before it changes anything and raises
a ``CacheError`` subclass otherwise. The contracts: ``protocol.Cache``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.allocator import PageAllocator
from tpcache.cache.keys import join_pages
from tpcache.cache.policy.policies import make_policy
from tpcache.cache.prefix import PrefixCache
from tpcache.cache.protocol import Evictor
from tpcache.cache.records import (
    AdmitResult,
    CacheConfig,
    CacheSizes,
    EvictResult,
    Handle,
    MatchResult,
    RequestId,
)
from tpcache.cache.reqtable import Taken
from tpcache.cache.tree.node import Node, pages_of
from tpcache.cache.tree.shapes import Freed
from tpcache.cache.tree.tree import RadixTree

__all__ = [
    "AdmitResult",
    "CacheConfig",
    "CacheSizes",
    "EvictResult",
    "Evictor",
    "Handle",
    "MatchResult",
    "OnePoolCache",
    "RadixCache",
]


class OnePoolCache(PrefixCache):
    """What a one-pool cache kind gives ``PrefixCache``: results without SWA pages (and
    no ``swa`` part). ``RadixCache`` and the host tier's ``HostCache`` are such kinds;
    the hybrid cache gives its own."""

    def _match_result(self, path: list[Any], n: int) -> MatchResult:
        if len(path) > 1:
            pages = join_pages(map(pages_of, path))
        else:  # a copy either way: the caller must not get the tree's own array
            pages = path[0].pages.copy() if path else np.zeros(0, np.int64)
        handle = self.handles.make(path[-1] if path else self.tree.root)
        return MatchResult(n, pages, handle, self.page_size)

    def _admit_result(self, rid: RequestId, taken: Taken, total: int) -> AdmitResult:
        return AdmitResult(taken.pos, taken.row, total, self.page_size)

    def _evict_result(self, out: Freed) -> EvictResult:
        return EvictResult(out.full * self.page_size, len(out.dead))

    def sizes(self) -> CacheSizes:
        return self.pool_sizes()[0]


class RadixCache(OnePoolCache):
    """A paged radix prefix cache over one pool, with its allocator and request table;
    built with no part (``swa`` and ``host`` are None)."""

    def __init__(self, config: CacheConfig) -> None:
        alloc = PageAllocator(config.num_pages, config.page_size)
        key_fn, hooks = make_policy(config.policy, config.num_pages, config.policy_params)
        tree: RadixTree[Node] = RadixTree(
            alloc, key_fn, record_events=config.record_events, medium=config.medium, hooks=hooks
        )
        super().__init__(config, alloc, tree)
