"""Configuration and result records of the hybrid (full + sliding-window) cache.

The records extend the one-pool cache's (``records.py``), so code written for
``RadixCache`` reads a ``HybridCache``'s results unchanged; the SWA fields come last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpcache.cache.errors import CacheError
from tpcache.cache.keys import pages_to_slots
from tpcache.cache.policy.policies import POLICIES
from tpcache.cache.records import (
    AdmitResult,
    CacheOptions,
    CacheSizes,
    EvictResult,
    Handle,
    MatchResult,
    request_limit,
)


class InvalidConfig(CacheError, ValueError):
    """A cache configuration that cannot work; the message says which field and why."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class HybridConfig(CacheOptions):
    """Shape of one hybrid cache. Pool sizes are tokens, rounded down to whole pages.

    ``sliding_window``: tokens an SWA layer attends to before the current one; a whole
    number of pages. The SWA pool may not be larger than the full pool (every cached or
    running token has full KV; SWA KV is a subset). A running request holds SWA KV for
    all its own tokens, so requests are limited by the SWA pool too.
    """

    capacity_tokens: int
    swa_capacity_tokens: int
    sliding_window: int
    page_size: int = 1
    policy: str = "lru"

    def __post_init__(self) -> None:
        ps = self.page_size
        if not _is_int(ps) or ps < 1:
            raise InvalidConfig(f"page_size must be an int >= 1, got {ps!r}")
        for name in ("capacity_tokens", "swa_capacity_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < ps:
                raise InvalidConfig(f"{name} must be an int >= page_size ({ps}), got {value!r}")
        if self.swa_capacity_tokens // ps > self.capacity_tokens // ps:
            raise InvalidConfig(
                f"the SWA pool ({self.swa_capacity_tokens} tokens) may not be larger than the"
                f" full pool ({self.capacity_tokens} tokens)"
            )
        w = self.sliding_window
        if not _is_int(w) or w <= 0:
            raise InvalidConfig(f"sliding_window must be an int > 0 tokens, got {w!r}")
        if w % ps:
            raise InvalidConfig(
                f"sliding_window ({w} tokens) must be a whole number of pages of {ps}"
            )
        if self.policy not in POLICIES:
            raise InvalidConfig(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        m = self.max_request_tokens
        if m is not None and (not _is_int(m) or m < 1):
            raise InvalidConfig(f"max_request_tokens must be an int >= 1, got {m!r}")

    @property
    def request_limit(self) -> int:
        return request_limit(self.num_swa_pages, self.page_size, self.max_request_tokens)

    @property
    def num_pages(self) -> int:
        return self.capacity_tokens // self.page_size

    @property
    def num_swa_pages(self) -> int:
        return self.swa_capacity_tokens // self.page_size


@dataclass(frozen=True, slots=True)
class SwaHandle(Handle):
    """A matched prefix and the boundary mark where its SWA lock stops (opaque)."""

    swa_boundary: int


@dataclass(slots=True)
class SwaMatchResult(MatchResult):
    """A window-valid cached prefix. ``swa_pages``: the SWA pages of its last window
    (the pages from token ``swa_start`` on), what an SWA layer attends to after it."""

    swa_pages: np.ndarray

    @property
    def swa_start(self) -> int:
        """Token index where ``swa_pages`` begin."""
        return self.prefix_len - self.swa_pages.size * self.page_size

    @property
    def swa_slots(self) -> np.ndarray:
        return pages_to_slots(self.swa_pages, self.page_size)


@dataclass(slots=True)
class SwaAdmitResult(AdmitResult):
    """An admitted request. ``swa_pages``: SWA pages of the row from token ``swa_start``
    on: the matched prefix's last window, then every page of the request's own."""

    swa_pages: np.ndarray

    @property
    def swa_start(self) -> int:
        return (self.pages.size - self.swa_pages.size) * self.page_size

    @property
    def swa_slots(self) -> np.ndarray:
        return pages_to_slots(self.swa_pages, self.page_size, self.num_tokens - self.swa_start)


@dataclass(frozen=True)
class SwaEvictResult(EvictResult):
    """``num_tokens``: full KV tokens freed; ``swa_tokens``: SWA KV tokens freed (deleted
    nodes' and tombstoned nodes'); ``num_nodes`` deleted, ``tombstoned`` made tombstones."""

    swa_tokens: int
    tombstoned: int


@dataclass(frozen=True)
class HybridSizes(CacheSizes):
    """Token counts. The inherited fields are the full pool's; ``swa`` the SWA pool's.
    Conservation holds per pool: free + evictable + protected + held == capacity."""

    swa: CacheSizes
    tombstones: int  # tombstone nodes
    tombstone_tokens: int  # their tokens (full KV kept, SWA KV dropped)

    @property
    def full(self) -> CacheSizes:
        return CacheSizes(self.capacity, self.free, self.evictable, self.protected, self.held)
