"""Shared helpers of the tests/test_swa_*.py files (not a test module)."""

from __future__ import annotations

from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

NodeView = tuple[list[int], list[int], list[int] | None, int, int]


def hybrid(
    full: int = 64,
    swa: int = 64,
    window: int = 4,
    page_size: int = 1,
    policy: str = "lru",
) -> HybridCache:
    return HybridCache(HybridConfig(full, swa, window, page_size, policy, record_events=True))


def run(cache: HybridCache, rid: object, tokens: list[int], output: list[int] = ()) -> object:
    """Admit, decode ``output`` and finish ``rid``; returns the admit result."""
    got = cache.admit(rid, tokens)
    if output:
        cache.extend(rid, len(output))
    cache.finish(rid, list(output))
    return got


def view(cache: HybridCache) -> list[NodeView]:
    """(tokens, full pages, SWA pages or None for a tombstone, lock, SWA lock) per node,
    parents first, children in key order."""
    out = []
    for n in cache.tree.walk():
        swa = None if n.tombstone else cache.alloc.swa_of(n.pages).tolist()
        out.append((n.key.tolist(), n.pages.tolist(), swa, n.lock, n.swa_lock))
    return out


def snapshot(cache: HybridCache) -> tuple[int, object]:
    """What a rejected call must leave unchanged."""
    return cache.digest(), cache.sizes()


def pools(cache: HybridCache) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(full free/evictable/protected/held, SWA the same, tombstones, tombstone tokens)."""
    s = cache.sizes()
    full = (s.free, s.evictable, s.protected, s.held)
    swa = (s.swa.free, s.swa.evictable, s.swa.protected, s.swa.held)
    return full, swa, s.tombstones, s.tombstone_tokens
