"""``RadixCache``: the one-pool cache (full-attention models), the state machine every TP
rank and the coordinator run.

It is ``PrefixCache`` (``prefix.py``: the request lifecycle and the tree-level calls)
over a ``PageAllocator`` and a ``RadixTree`` with the configured eviction policy. The
same op sequence gives the same tree, the same slot ids and the same digest in every
process; every public method validates its input before it changes anything and raises
a ``CacheError`` subclass otherwise. The contracts: ``protocol.Cache``.
"""

from __future__ import annotations

from tpcache.cache.allocator import PageAllocator
from tpcache.cache.policies import make_policy
from tpcache.cache.prefix import PrefixCache
from tpcache.cache.protocol import Evictor
from tpcache.cache.records import (
    AdmitResult,
    CacheConfig,
    CacheSizes,
    EvictResult,
    Handle,
    MatchResult,
)
from tpcache.cache.tree import RadixTree

__all__ = [
    "AdmitResult",
    "CacheConfig",
    "CacheSizes",
    "EvictResult",
    "Evictor",
    "Handle",
    "MatchResult",
    "RadixCache",
]


class RadixCache(PrefixCache):
    """A paged radix prefix cache over one pool, with its allocator and request table."""

    def __init__(self, config: CacheConfig) -> None:
        alloc = PageAllocator(config.num_pages, config.page_size)
        key_fn, hooks = make_policy(config.policy, config.num_pages, config.policy_params)
        tree = RadixTree(
            alloc, key_fn, record_events=config.record_events, medium=config.medium, hooks=hooks
        )
        super().__init__(config, alloc, tree)
