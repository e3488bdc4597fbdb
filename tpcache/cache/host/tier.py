"""``HostTier``: the host-tier part of ``HostCache`` (``cache.host``, the
``parts.HostPart`` calls): the host pool's figures, the copy log's completion, and
which running requests' forwards wait for which copies (``waits.py``).

The cache's own decisions never wait for a copy (``host/cache.py``'s docstring): this
part is what the layers above ask before a forward, and what a rank runs between its
pools. It reads the cache's tiered tree and request table (the table is the cache's
current one, which a reset replaces).
"""

from __future__ import annotations

from typing import Protocol

from tpcache.cache.errors import IntegrityError
from tpcache.cache.host.config import HostCopy
from tpcache.cache.host.tree import HostTree
from tpcache.cache.host.waits import CopyWaits
from tpcache.cache.records import CacheSizes, HostTierStats, RequestId
from tpcache.cache.reqtable import ReqTable


class Tiered(Protocol):
    """The host cache as its host part reads it (named by shape: no import of it)."""

    page_size: int
    tree: HostTree
    reqs: ReqTable


class HostTier:
    """The host tier's calls of a cache built with one (``parts.HostPart``). Owned here:
    ``waits``, whose forwards wait for which copies; the cache records a row's new
    pages in it (``waits.record``) and forgets a request that ends."""

    def __init__(self, cache: Tiered) -> None:
        self.cache = cache
        self.waits = CopyWaits(cache.tree.copies)

    # ---- the host pool ----------------------------------------------------------------------
    def sizes(self) -> CacheSizes:
        t, ps = self.cache.tree, self.cache.page_size
        a = t.host_alloc
        return CacheSizes(
            a.num_pages * ps, a.num_free * ps, t.host_only_pages() * ps, t.copy_pages * ps, 0
        )

    def counts(self) -> dict[str, int]:
        t = self.cache.tree
        return {
            "written_pages": t.written_pages,
            "loaded_pages": t.loaded_pages,
            "host_evicted_pages": t.host_evicted_pages,
            "copies_started": t.copies.started,
            "copies_completed": t.copies.completed,
        }

    def stats(self) -> HostTierStats:
        t, ps = self.cache.tree, self.cache.page_size
        return HostTierStats(
            self.sizes(),
            t.written_pages * ps,
            t.loaded_pages * ps,
            t.host_evicted_pages * ps,
            self.copies_pending(),
        )

    # ---- copy completion --------------------------------------------------------------------
    def copies_pending(self) -> int:
        c = self.cache.tree.copies
        return c.started - c.completed

    def copies_completed(self) -> int:
        return self.cache.tree.copies.completed

    def copies_done(self, n: int) -> None:
        self.waits.done(n)

    def local_after(self, rid: RequestId) -> int:
        self.cache.reqs.get(rid)
        return self.waits.local.get(rid, 0)

    def ready_after(self, rid: RequestId) -> int:
        self.cache.reqs.get(rid)
        return self.waits.waits.get(rid, 0)

    def request_ready(self, rid: RequestId) -> bool:
        return self.ready_after(rid) <= self.copies_completed()

    def take_copies(self) -> list[HostCopy]:
        return self.cache.tree.copies.take()

    def check(self) -> None:
        """Raise ``IntegrityError`` unless the host pool conserves its pages and every
        wait is a running request's, on copies started and not known done."""
        s = self.sizes()
        total = s.free + s.evictable + s.protected + s.held
        if total != s.capacity:
            raise IntegrityError(
                f"host pool: free {s.free} + evictable {s.evictable} + protected {s.protected}"
                f" + held {s.held} = {total} != capacity {s.capacity}"
            )
        self.waits.check(self.cache.reqs)
