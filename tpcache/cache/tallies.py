"""What a whole cache reports of itself, for every cache kind: its sizes per pool (the
conservation law's terms) and its digest (the lockstep's comparison). Read-only."""

from __future__ import annotations

from typing import Any, Protocol

from tpcache.cache.allocator import HELD, LENT
from tpcache.cache.parts import HostPart
from tpcache.cache.records import CacheSizes
from tpcache.cache.reqtable import ReqTable
from tpcache.cache.tree.handles import HandleLocks
from tpcache.cache.tree.hashing import fmix64_int, fold_fields
from tpcache.cache.tree.shapes import TreeShape


class CacheShape(Protocol):
    """``prefix.PrefixCache`` as its reports and checks read it (here, and
    ``tree_check.check_cache``), named by shape so that they need not import it."""

    page_size: int
    pool_names: tuple[str, ...]
    alloc: Any  # a PageAllocator, or a PairedAllocator
    tree: TreeShape
    reqs: ReqTable
    handles: HandleLocks

    @property
    def num_pools(self) -> int: ...
    def pool_sizes(self) -> tuple[CacheSizes, ...]: ...


class WithParts(Protocol):
    """A cache as ``host_figures`` reads it: its host tier, if it was built with one."""

    @property
    def host(self) -> HostPart | None: ...


def pool_sizes(cache: CacheShape) -> tuple[CacheSizes, ...]:
    """Capacity, free, evictable, protected and held tokens of each pool, in
    ``cache.pool_names`` order."""
    ps, alloc, tree = cache.page_size, cache.alloc, cache.tree
    # Every held or lent page has a page in each pool (check_integrity verifies it).
    held = (alloc.count(HELD) + alloc.count(LENT)) * ps
    return tuple(
        CacheSizes(cap * ps, free * ps, (cached - kept) * ps, kept * ps, held)
        for cap, free, (cached, kept) in zip(
            alloc.pool_pages(), alloc.pool_free(), tree.pool_pages(), strict=True
        )
    )


def cache_digest(cache: CacheShape) -> int:
    """A 64-bit fold of the tree (keys, pages, priorities, locks), the allocator and the
    running requests: equal on two processes iff their caches agree (w.h.p.)."""
    t = cache.tree
    t.ensure_hashed()
    fields = (*cache.alloc.fingerprint(), t.tick, len(t.nodes), t.protected_pages)
    return fold_fields(
        fmix64_int(t.digest_sum ^ 0x5A17), (*fields, len(cache.reqs), *t.digest_fields())
    )


def host_figures(cache: WithParts) -> dict[str, int]:
    """A host tier's pool and moves in tokens (``HostPart.stats``; none without one), as
    a coordinator's ``stats()`` reports them: since the cache was made, a reset included.
    ``host_hit_tokens`` (loaded back) are part of the prefix hits."""
    if cache.host is None:
        return {}
    tier = cache.host.stats()
    pool = ("capacity", "free", "evictable", "protected")  # the host pool's sizes
    return {
        **{f"host_{k}": getattr(tier.sizes, k) for k in pool},
        "host_hit_tokens": tier.loaded_tokens,
        "written_back_tokens": tier.written_tokens,
        "host_evicted_tokens": tier.host_evicted_tokens,
        "copies_pending": tier.copies_pending,
    }
