"""Configuration and result records of the cache with a host (CPU) tier.

The records extend the one-pool cache's (``records.py``), so code written for
``RadixCache`` reads a ``HostCache``'s results unchanged; the host fields come last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpcache.cache.errors import HostTierError
from tpcache.cache.policy.policies import POLICIES
from tpcache.cache.records import AdmitResult, CacheConfig, MatchResult

WRITE_BACK = "write_back"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_POLICIES = (WRITE_BACK, WRITE_THROUGH_SELECTIVE)
HOST = "CPU"  # the events' medium of the host tier


@dataclass(frozen=True)
class HostConfig(CacheConfig):
    """A one-pool cache (``CacheConfig``) with a host pool of ``host_capacity_tokens``
    (rounded down to whole pages).

    ``write_policy``: ``write_back`` copies a device node to the host when it is evicted
    from the device (exclusive tiers: a load back frees the host copy);
    ``write_through_selective`` copies a node once ``write_through_hits`` matches used it
    and keeps the copy when it is loaded back (a device node evicted without a copy is
    dropped). ``record_copies`` keeps every started copy for ``take_copies`` (a rank
    runs them); a replay leaves it off and keeps counters only. ``defer_copies``: copies
    complete only when ``copies_done`` says so (a lockstep: the ranks agree how many are
    done); off, each completes as it starts (one process, a replay).
    """

    host_capacity_tokens: int = 0
    write_policy: str = WRITE_BACK
    write_through_hits: int = 2
    record_copies: bool = False
    defer_copies: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        cap = self.host_capacity_tokens
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < self.page_size:
            raise HostTierError(
                f"host_capacity_tokens must be an int >= page_size ({self.page_size}), got {cap!r}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise HostTierError(
                f"unknown write policy {self.write_policy!r}; known: {', '.join(WRITE_POLICIES)}"
            )
        hits = self.write_through_hits
        if not isinstance(hits, int) or isinstance(hits, bool) or hits < 1:
            raise HostTierError(f"write_through_hits must be an int >= 1, got {hits!r}")
        if self.medium == HOST:
            # Its events would not tell the two tiers apart (a router counts each copy).
            raise HostTierError(f"medium {HOST!r} is the host tier's own; name the device's")
        if self.policy not in POLICIES:
            # A stateful policy learns from what leaves the cache; the host tier would
            # have to tell it of two orders. Refused until it is taught.
            raise HostTierError(
                f"policy {self.policy!r} has no host tier; use one of {', '.join(POLICIES)}"
            )

    @property
    def num_host_pages(self) -> int:
        return self.host_capacity_tokens // self.page_size

    @property
    def through_hits(self) -> int | None:
        """Hits that copy a node to the host; ``None`` under write-back."""
        return self.write_through_hits if self.write_policy == WRITE_THROUGH_SELECTIVE else None


@dataclass(slots=True)
class HostMatchResult(MatchResult):
    """A ``MatchResult`` (the device prefix: ``prefix_len``, its pages and a handle),
    ``host_hit_length``: tokens beyond it cached on the host only (an admit would load
    them), and ``ready_after``: how many copies of the copy log must be done (agreed)
    before the device prefix's pages hold their KV (0: now; some may be another
    request's load still under way). Reading them sooner reads what was there before."""

    host_hit_length: int = 0
    ready_after: int = 0


@dataclass(slots=True)
class HostAdmitResult(AdmitResult):
    """An ``AdmitResult`` whose ``prefix_len`` counts every cached token the request got,
    and ``host_hit_length``: how many of them (the last ones of the prefix) were loaded
    from the host (their copies are in the cache's copy log), and ``ready_after``: how
    many copies of the copy log must be done before the request's forward may read or
    write its row (0: at once; see ``HostPart.request_ready``)."""

    host_hit_length: int = 0
    ready_after: int = 0


@dataclass(frozen=True, slots=True)
class HostCopy:
    """One copy the cache started: ``to_host`` (device -> host, a write) or back (a
    load), page for page. Ids count from 0 per cache, across reset."""

    id: int
    to_host: bool
    device_pages: np.ndarray
    host_pages: np.ndarray
