"""The one place a cache is built: a spec (``CacheSpec``, less its capacity) and
``build(spec, capacity)``.

A cache is the prefix cache with the parts its spec asks for: a sliding window (an SWA
pool beside the full one: ``HybridCache``) or a host tier (a host pool behind the
device one: ``HostCache``), or neither (``RadixCache``). The two parts do not combine
(``SwaHostTierError``): the host tier moves a node's pages of one pool between the
tiers, and a windowed node has two pools and tombstones that have no host copy. Every
rank, the coordinator's mirror and a replay build through here, so one spec gives the
same cache, slot ids and digest in every process.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpcache.cache.errors import CacheError, HostTierError, SwaHostTierError
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

__all__ = ["CacheSpec", "SwaHostTierError", "build"]


@dataclass(frozen=True)
class CacheSpec:
    """The cache every rank and the mirror build, less its capacity (agreed at start-up).

    ``sliding_window`` set: the hybrid cache (full + SWA pools, ``HybridCache``) with an
    SWA pool of ``swa_capacity_tokens`` (None: as large as the full pool; never larger).
    ``host_capacity_tokens`` set: the cache with a host tier (``HostCache``) of that many
    tokens per rank, ``write_policy`` and ``write_through_hits`` as in ``HostConfig``.
    Both set: ``SwaHostTierError``. Raises the config's ``CacheError`` on construction,
    before any capacity is known.
    """

    page_size: int = 16
    policy: str = "lru"
    max_request_tokens: int | None = None
    sliding_window: int | None = None
    swa_capacity_tokens: int | None = None
    host_capacity_tokens: int | None = None
    write_policy: str = "write_back"
    write_through_hits: int = 2

    def __post_init__(self) -> None:
        CacheConfig(capacity_tokens=self.page_size, page_size=self.page_size, policy=self.policy)
        if self.host_capacity_tokens is not None:
            if self.sliding_window is not None:
                raise SwaHostTierError(
                    "sliding_window (the SWA pool) and host_capacity_tokens (a host tier) cannot"
                    " both be set: the hybrid (SWA) cache has no host tier"
                )
            host_config(self, one_pool_config(self, self.page_size))
        if self.sliding_window is not None:
            hybrid_config(self, max(self.swa_capacity_tokens or 0, self.page_size))
        elif self.swa_capacity_tokens is not None:
            raise CacheError("swa_capacity_tokens needs a sliding_window (the hybrid cache)")

    def build(self, capacity_tokens: int, record_events: bool = False, rank: bool = False) -> Cache:
        """A lockstep's cache of ``capacity_tokens`` (``build``): its host copies complete
        when the ranks agree they are done; ``rank``: a rank's, which keeps the copies it
        must run (a mirror only counts them)."""
        return build(
            self,
            capacity_tokens,
            record_events=record_events,
            record_copies=rank,
            defer_copies=True,
        )


def build(
    spec: CacheSpec,
    capacity_tokens: int,
    *,
    record_events: bool = False,
    record_copies: bool = False,
    defer_copies: bool = False,
) -> Cache:
    """The cache ``spec`` describes, of ``capacity_tokens`` in its full (device) pool.

    ``record_copies`` and ``defer_copies`` are the host tier's (``HostConfig``): off, as
    in a replay, each copy completes as it starts and only its counters are kept. Raises
    the config's ``CacheError`` for a capacity it cannot take."""
    if spec.host_capacity_tokens is not None:
        one_pool = one_pool_config(spec, capacity_tokens, record_events)
        return HostCache(host_config(spec, one_pool, record_copies, defer_copies))
    if spec.sliding_window is not None:
        return HybridCache(hybrid_config(spec, capacity_tokens, record_events))
    return RadixCache(one_pool_config(spec, capacity_tokens, record_events))


def one_pool_config(
    spec: CacheSpec, capacity_tokens: int, record_events: bool = False
) -> CacheConfig:
    """The one-pool configuration of ``spec`` (the host tier's extends it)."""
    return CacheConfig(
        capacity_tokens=capacity_tokens,
        page_size=spec.page_size,
        policy=spec.policy,
        record_events=record_events,
        max_request_tokens=spec.max_request_tokens,
    )


def host_config(
    spec: CacheSpec, one_pool: CacheConfig, record_copies: bool = False, defer_copies: bool = False
) -> HostConfig:
    """The host tier's configuration of ``spec``: ``one_pool`` (its ``one_pool_config``)
    with the tier behind it; ``HostTierError`` if it has none."""
    host = spec.host_capacity_tokens
    if host is None:
        raise HostTierError("no host_capacity_tokens: this cache has no host tier")
    return HostConfig(
        **vars(one_pool),
        host_capacity_tokens=host,
        write_policy=spec.write_policy,
        write_through_hits=spec.write_through_hits,
        record_copies=record_copies,
        defer_copies=defer_copies,
    )


def hybrid_config(
    spec: CacheSpec, capacity_tokens: int, record_events: bool = False
) -> HybridConfig:
    """The hybrid cache's configuration of ``spec``: its SWA pool cut to the full pool's
    size (the capacity is agreed after the spec is written). ``CacheError`` without a
    window."""
    window = spec.sliding_window
    if window is None:
        raise CacheError("no sliding_window: this cache has no SWA pool")
    swa = spec.swa_capacity_tokens or capacity_tokens
    return HybridConfig(
        capacity_tokens=capacity_tokens,
        swa_capacity_tokens=min(swa, capacity_tokens),
        sliding_window=window,
        page_size=spec.page_size,
        policy=spec.policy,
        record_events=record_events,
        max_request_tokens=spec.max_request_tokens,
    )
