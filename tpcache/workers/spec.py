"""What every rank of one TP group is configured with: the cache it builds (``CacheSpec``)
and the rest of the rank (``WorkerSpec``). Plain records, identical on every rank and in
the coordinator's mirror.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcache.cache.errors import CacheError, HostTierError
from tpcache.cache.host_cache import HostCache, HostConfig
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa_cache import HybridCache
from tpcache.cache.swa_config import HybridConfig
from tpcache.errors import TpcacheError
from tpcache.group.spec import check_seconds
from tpcache.kv.pool import PoolSpec
from tpcache.model.runner_spec import RunnerSpec


class WorkerSpecError(TpcacheError, ValueError):
    """A rank's spec (or its rank number) is invalid; the message names the field."""


@dataclass(frozen=True)
class CacheSpec:
    """The cache every rank and the mirror build, less its capacity (agreed at start-up).

    ``sliding_window`` set: the hybrid cache (full + SWA pools, ``HybridCache``) with an
    SWA pool of ``swa_capacity_tokens`` (None: as large as the full pool; never larger).
    ``host_capacity_tokens`` set: the cache with a host tier (``HostCache``) of that many
    tokens per rank, ``write_policy`` and ``write_through_hits`` as in ``HostConfig``;
    its copies complete when the ranks agree they are done (``workers/copysync.py``).
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
                raise HostTierError("the hybrid (SWA) cache has no host tier")
            self._host_config(self.page_size, False, False)
        if self.sliding_window is not None:
            self._hybrid_config(max(self.swa_capacity_tokens or 0, self.page_size), False)
        elif self.swa_capacity_tokens is not None:
            raise CacheError("swa_capacity_tokens needs a sliding_window (the hybrid cache)")

    def _host_config(self, capacity_tokens: int, record_events: bool, rank: bool) -> HostConfig:
        host = self.host_capacity_tokens
        if host is None:
            raise HostTierError("no host_capacity_tokens: this cache has no host tier")
        return HostConfig(
            capacity_tokens=capacity_tokens,
            page_size=self.page_size,
            policy=self.policy,
            record_events=record_events,
            max_request_tokens=self.max_request_tokens,
            host_capacity_tokens=host,
            write_policy=self.write_policy,
            write_through_hits=self.write_through_hits,
            record_copies=rank,
            defer_copies=True,
        )

    def _hybrid_config(self, capacity_tokens: int, record_events: bool) -> HybridConfig:
        window = self.sliding_window
        if window is None:
            raise CacheError("no sliding_window: this cache has no SWA pool")
        swa = self.swa_capacity_tokens or capacity_tokens
        return HybridConfig(
            capacity_tokens=capacity_tokens,
            swa_capacity_tokens=min(swa, capacity_tokens),
            sliding_window=window,
            page_size=self.page_size,
            policy=self.policy,
            record_events=record_events,
            max_request_tokens=self.max_request_tokens,
        )

    def build(self, capacity_tokens: int, record_events: bool = False, rank: bool = False) -> Cache:
        """The cache of ``capacity_tokens``; ``rank``: a rank's, which keeps the copies it
        must run (a mirror only counts them)."""
        if self.host_capacity_tokens is not None:
            return HostCache(self._host_config(capacity_tokens, record_events, rank))
        if self.sliding_window is not None:
            return HybridCache(self._hybrid_config(capacity_tokens, record_events))
        return RadixCache(
            CacheConfig(
                capacity_tokens=capacity_tokens,
                page_size=self.page_size,
                policy=self.policy,
                record_events=record_events,
                max_request_tokens=self.max_request_tokens,
            )
        )


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of one TP group is configured with (identical on every rank).

    ``timeout_s`` bounds each collective (how fast a hung rank is found);
    ``join_timeout_s`` bounds joining the group at start-up and after a recovery (how long
    a slow-starting rank may take). See ``GroupSpec``.
    """

    pool: PoolSpec
    cache: CacheSpec = field(default_factory=CacheSpec)
    capacity_tokens: int | None = None  # None: as many slots as the budget allows
    cpu_budget_bytes: int = 256 << 20
    gpu_fraction: float = 0.8
    backend: str = "auto"
    timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    # The model runner every rank builds and loads at construction (None: none until
    # load_model/load_runner); ``pool`` must then be the pool its layout asks for
    # (``runner_spec.runner_pool``).
    runner: RunnerSpec | None = None

    def __post_init__(self) -> None:
        if self.capacity_tokens is not None and self.capacity_tokens < self.cache.page_size:
            raise WorkerSpecError(
                f"capacity_tokens={self.capacity_tokens} is below one page of {self.cache.page_size}"
            )
        # Checked here as well as in GroupSpec: a bad value fails before any rank starts.
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("join_timeout_s", self.join_timeout_s)
