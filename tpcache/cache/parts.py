"""The parts a cache may be built with, and the calls each adds (``cache.swa``,
``cache.host``; ``protocol.Cache``): a cache built without a part has ``None`` there and
none of its calls, so no layer asks a cache a question it has no answer to.

``SwaPart``: the sliding window (``swa/slots.py`` implements it for ``HybridCache``).
``HostPart``: the host tier (``host/tier.py``, for ``HostCache``). The factory builds a
cache with one part at most (``factory.py``: they do not combine).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tpcache.cache.host.config import HostCopy
from tpcache.cache.keys import TokenLike
from tpcache.cache.records import CacheSizes, HostTierStats, RequestId


class SwaPart(Protocol):
    """The sliding window of a cache built with one (``cache.swa``): an SWA pool beside
    the full one, whose KV a request's SWA layers read and write. Every call is pure."""

    @property
    def window(self) -> int:
        """Tokens an SWA layer attends to before the current one."""
        ...

    def slots(self, slots: TokenLike) -> np.ndarray:
        """The SWA-pool slots paired with full-pool ``slots`` (each page's SWA page, the
        same offset). Raises ``InvalidSlots`` for ids out of range or pages with no SWA
        page."""
        ...

    def request_slots(self, rid: RequestId, start: int) -> tuple[int, np.ndarray]:
        """For a forward of ``rid`` whose first new token is at ``start``: ``(swa_start,
        SWA slots of positions swa_start .. its end)``, ``swa_start = max(0, start -
        window)``, the KV its SWA layers read and write. Raises ``UnknownRequest``,
        ``InvalidSlots`` for ``start`` outside the row."""
        ...

    def tombstoned_pages(self, pages: TokenLike) -> int:
        """How many of full ``pages`` (e.g. a matched prefix's) lost their SWA KV. Raises
        ``InvalidSlots`` for ids out of range."""
        ...


class HostPart(Protocol):
    """The host tier of a cache built with one (``cache.host``): a host pool behind the
    device one, and the copy log of the moves between them. The cache's decisions never
    wait for a copy; a request's forward does (``ready_after``, ``local_after``)."""

    def stats(self) -> HostTierStats:
        """The host pool and the moves since the cache was made, in tokens. Pure."""
        ...

    def sizes(self) -> CacheSizes:
        """Token counts of the host pool: host-only pages are evictable, copies of
        device-resident nodes protected (they go with their node), nothing held. Pure."""
        ...

    def counts(self) -> dict[str, int]:
        """Pages written to the host, loaded back and dropped by host eviction since
        creation, and copies started and completed. Statistics, never a decision. Pure."""
        ...

    def copies_pending(self) -> int:
        """Copies started and not yet known done (always 0 without ``defer_copies``). Pure."""
        ...

    def copies_completed(self) -> int:
        """How many copies of the copy log are known done. Pure."""
        ...

    def copies_done(self, n: int) -> None:
        """The first ``n`` copies of the copy log are done (in a lockstep: on every rank,
        as agreed by MIN). Requests whose ``ready_after`` is reached may run their
        forward. ``n`` at or below the known count changes nothing. Raises
        ``HostTierError`` (nothing changed) for an ``n`` that is not an int >= 0 or is
        more than the copies started."""
        ...

    def ready_after(self, rid: RequestId) -> int:
        """How many copies must be done on every rank (agreed) before request ``rid``'s
        forward may run (0: none): the loads into its row's pages, which the forward
        reads. Raises ``UnknownRequest``. Pure."""
        ...

    def local_after(self, rid: RequestId) -> int:
        """How many copies of the copy log a rank's own engine must have done before
        request ``rid``'s forward writes its row there (0: none): the copies still
        reading pages it was given, and its loads. Raises ``UnknownRequest``. Pure."""
        ...

    def request_ready(self, rid: RequestId) -> bool:
        """Whether ``rid``'s forward may run: every copy it waits for is done. Raises
        ``UnknownRequest``. Pure."""
        ...

    def take_copies(self) -> list[HostCopy]:
        """The copies started since the last call, in id order (empty unless
        ``record_copies``): what a rank runs between its pools."""
        ...
