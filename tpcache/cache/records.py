"""The caches' small typed records: the one-pool cache's configuration, the handle it
gives out, and what the calls of every cache return. They cross module boundaries
(workers, coordinator); the sliding window's records extend them (``swa_config.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from tpcache.cache.errors import CacheError
from tpcache.cache.keys import pages_to_slots, read_only
from tpcache.cache.policy.policies import CACHE_POLICIES, check_policy_params

# A running request's id, as every cache call takes it (checked: ``reqtable.check_request_id``).
RequestId = int | str


@dataclass(frozen=True, kw_only=True)
class CacheOptions:
    """What every cache kind's configuration has beyond its pools (keyword-only)."""

    record_events: bool = False  # queue KV events (``take_events``)
    max_request_tokens: int | None = None  # None: as many as the pools hold
    medium: str = "GPU"  # the events' medium


@dataclass(frozen=True)
class CacheConfig(CacheOptions):
    """Shape of one cache. ``capacity_tokens`` is rounded down to whole pages."""

    capacity_tokens: int
    page_size: int = 1
    policy: str = "lru"
    policy_params: object = None  # the policy's parameter record (e.g. ResightParams), or None

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise CacheError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if not isinstance(self.capacity_tokens, int) or self.capacity_tokens < self.page_size:
            raise CacheError(
                f"capacity_tokens must be an int >= page_size ({self.page_size}), "
                f"got {self.capacity_tokens!r}"
            )
        if self.policy not in CACHE_POLICIES:
            raise CacheError(f"unknown policy {self.policy!r}; known: {', '.join(CACHE_POLICIES)}")
        check_policy_params(self.policy, self.policy_params)
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise CacheError(f"max_request_tokens must be >= 1, got {self.max_request_tokens}")

    @property
    def num_pages(self) -> int:
        return self.capacity_tokens // self.page_size

    @property
    def request_limit(self) -> int:
        return request_limit(self.num_pages, self.page_size, self.max_request_tokens)


def request_limit(pages: int, page_size: int, max_request_tokens: int | None) -> int:
    """Tokens one request may hold: a pool of ``pages`` whole pages, or less."""
    cap = pages * page_size
    return cap if max_request_tokens is None else min(cap, max_request_tokens)


@dataclass(frozen=True, slots=True)
class Handle:
    """Opaque reference to a matched prefix; pass it back to ``lock``/``unlock`` of the
    cache that gave it out. ``owner`` names that cache and its generation (a new one at
    every ``reset``): a handle from another cache, or from before a reset, is refused.

    ``tag`` is what makes a handle the cache's own: a keyed hash of what the handle
    names, under a random key that only the issuing cache generation holds
    (``handles.HandleLocks``). Every other field is shown and can be copied, so a handle
    built by hand, or one with another node's id, has no valid tag and is refused. The
    tag never leaves the process and enters no digest (each process has its own key)."""

    node_id: int
    owner: int
    tag: bytes = field(default=b"", repr=False, kw_only=True)


_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A fresh handle owner (per cache and generation); only compared for equality, so it
    need not be the same across processes."""
    return next(_OWNERS)


@dataclass(slots=True)
class MatchResult:
    """A cached prefix: its length (whole pages), its pages and a handle to lock it.

    The caller's record (not frozen: that costs a microsecond per result): its pages are
    a copy, so nothing done to it reaches the cache."""

    prefix_len: int
    pages: np.ndarray
    handle: Handle
    page_size: int

    @property
    def slots(self) -> np.ndarray:
        return pages_to_slots(self.pages, self.page_size)


@dataclass(frozen=True)
class EvictResult:
    num_tokens: int
    num_nodes: int


@dataclass(slots=True)
class AdmitResult:
    """An admitted request: how much of it was cached, and the slots of the whole prompt.

    The caller's record, as ``MatchResult``; its pages are a read-only view."""

    prefix_len: int
    pages: np.ndarray
    num_tokens: int
    page_size: int

    def __post_init__(self) -> None:
        # Shown, not handed over: the pages are a running request's own row, which a
        # caller writing into them would corrupt.
        self.pages = read_only(self.pages)

    @property
    def slots(self) -> np.ndarray:
        return pages_to_slots(self.pages, self.page_size, self.num_tokens)


@dataclass(slots=True)
class RequestRow:
    """A running request as the cache holds it (read-only views, valid until the request
    next changes): the tokens it was given so far, the pages of its row, the slots it
    holds (``num_tokens``: tokens with KV, or about to have it) and how many of its
    leading tokens are the tree's (``cached_tokens``).

    The caller's record, as ``MatchResult`` (not frozen: the coordinator and the ranks
    read a row on every finish and forward, and a frozen record costs a microsecond)."""

    rid: RequestId
    tokens: np.ndarray
    pages: np.ndarray
    num_tokens: int
    cached_tokens: int
    page_size: int

    @property
    def slots(self) -> np.ndarray:
        """Full-pool slot ids of the ``num_tokens`` tokens (a new array)."""
        return pages_to_slots(self.pages, self.page_size, self.num_tokens)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the cache was made (a reset included); statistics only, never a
    decision. ``evicted_pages``: per pool (``pool_names`` order), freed by eviction (SWA:
    tombstoning too); ``tombstoned_nodes``: nodes that lost their SWA KV (0 without an
    SWA pool). The seconds of recent evict calls: ``evict_seconds()``."""

    evict_calls: int
    evicted_pages: tuple[int, ...]
    tombstoned_nodes: int


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A host tier's pool and its moves since the cache was made (a reset included), in
    tokens; statistics only, never a decision (``HostPart.stats``). ``sizes``: the host
    pool (evictable: host-only pages; protected: copies of device-resident nodes).
    ``loaded_tokens`` are the host hits: an admit loads what it matched on the host."""

    sizes: CacheSizes
    written_tokens: int  # copied to the host (write-back or write-through)
    loaded_tokens: int
    host_evicted_tokens: int  # dropped by the host pool's own eviction
    copies_pending: int  # started and not yet agreed done


@dataclass(frozen=True)
class CacheSizes:
    """Token counts. Conservation: free + evictable + protected + held == capacity."""

    capacity: int
    free: int
    evictable: int
    protected: int
    held: int

    @property
    def cached(self) -> int:
        return self.evictable + self.protected
