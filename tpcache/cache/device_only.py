"""``DeviceOnly``: the host-tier part of a cache built without a host tier.

A cache kind is the prefix cache (``prefix.py``) with its parts: the SWA pool or not
(``HybridCache``, ``OnePoolCache``), the host tier or not (``HostCache``, this). The
layers above ask every cache the host tier's questions (``protocol.Cache``: a mirror's
copies, a forward's readiness) without knowing its kind; this part answers them for a
cache whose KV is all on the device: no copy ever starts, every forward may run now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpcache.cache.errors import CacheError

if TYPE_CHECKING:
    from tpcache.cache.records import HostTierStats, RequestId
    from tpcache.cache.reqtable import ReqTable


class DeviceOnly:
    """The copy log's calls of ``protocol.Cache`` for a cache without one (a base ahead of
    ``PrefixCache``: it reads only the request table, to refuse an unknown request)."""

    reqs: ReqTable

    def host_tier(self) -> HostTierStats | None:
        return None

    def copies_pending(self) -> int:
        return 0

    def copies_completed(self) -> int:
        return 0

    def copies_done(self, n: int) -> None:
        if n != 0:
            raise CacheError(f"this cache starts no copies: {n!r} cannot be done")

    def ready_after(self, rid: RequestId) -> int:
        self.reqs.get(rid)
        return 0

    def request_ready(self, rid: RequestId) -> bool:
        self.reqs.get(rid)
        return True

    def take_copies(self) -> list[Any]:
        return []
