"""``HybridCache``: the cache for models mixing full and sliding-window attention layers.

It is ``PrefixCache`` (``prefix.py``: the same request lifecycle and tree-level calls as
``RadixCache``) over two pools, full and SWA, joined by a paired allocator
(``swa/allocator.py``), and the windowed tree (``swa/tree.py``: tombstones, window-aware
matches, the boundary lock, the SWA eviction order). Per-pool figures come as (full,
SWA) tuples; results also carry SWA pages. Its SWA calls are its part ``cache.swa``
(``swa/slots.py``). The contracts: ``protocol.Cache`` and ``parts.SwaPart``.

Decisions:
- A running request holds full and SWA slots for all its own tokens until it ends: no
  request-side freeing of SWA KV that slid out of its window. So a request may not be
  longer than the SWA pool, and every page a request holds has an SWA page.
- Insert over a tombstone revives it by moving the newcomer's SWA pages onto the
  tombstone's full pages; the newcomer's full pages are freed as duplicates. Full pages,
  block hashes and events stay as they are (a block is stored once and removed once,
  when its full KV goes; losing SWA KV is no event), and requests that hold the
  tombstone's full pages are safe.
- Every leaf stays a valid match end: a leaf that a tombstone left less than a window
  behind is deleted (it could never be matched), cascading upward.
- The SWA lock boundary is a mark on the top node of the lock's window, kept in the
  handle (``SwaHandle.swa_boundary``) and, for requests, in their row; a split moves it
  to the upper half. An unlock whose mark is not on the handle's path raises
  ``StaleBoundary`` and changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.errors import StaleBoundary
from tpcache.cache.keys import join_pages
from tpcache.cache.policy.policies import policy_key
from tpcache.cache.prefix import PrefixCache
from tpcache.cache.protocol import Evictor
from tpcache.cache.records import RequestId
from tpcache.cache.reqtable import Taken
from tpcache.cache.swa.allocator import PairedAllocator
from tpcache.cache.swa.config import (
    HybridConfig,
    HybridSizes,
    SwaAdmitResult,
    SwaEvictResult,
    SwaMatchResult,
)
from tpcache.cache.swa.evict import swa_policy_key
from tpcache.cache.swa.slots import SwaSlots
from tpcache.cache.swa.tree import SwaTree
from tpcache.cache.tree.node import pages_of
from tpcache.cache.tree.shapes import Freed

__all__ = ["HybridCache", "HybridEvictor", "StaleBoundary"]

HybridEvictor = Evictor  # called with the local shortfalls (full, SWA) in pages


class HybridCache(PrefixCache):
    """A paged radix prefix cache over a full and an SWA pool, with its request table.

    Owned as in ``PrefixCache``: ``alloc`` is the paired allocator, ``tree`` the
    windowed tree; ``swa`` (its ``SwaPart``, made here) reads them. Logical clock,
    per-cache ids and marks and the two FIFOs make every decision the same in every
    process. It has no host tier (``host`` is None).
    """

    pool_names = ("full", "SWA")

    def __init__(self, config: HybridConfig) -> None:
        alloc = PairedAllocator(config.num_pages, config.num_swa_pages, config.page_size)
        tree = SwaTree(
            alloc,
            policy_key(config.policy),
            config.sliding_window,
            swa_policy_key(config.policy),
            record_events=config.record_events,
            medium=config.medium,
        )
        super().__init__(config, alloc, tree)
        self.swa = SwaSlots(self)

    # ---- results with SWA pages ---------------------------------------------------------
    def _match_result(self, path: list[Any], n: int) -> SwaMatchResult:
        ps = self.page_size
        handle = self.handles.make(path[-1] if path else self.tree.root)
        pages = join_pages(map(pages_of, path)) if path else np.zeros(0, np.int64)
        swa = self.alloc.swa_of(pages[max(0, n - self.tree.window) // ps :])
        return SwaMatchResult(n, pages, handle, ps, swa)

    def _admit_result(self, rid: RequestId, taken: Taken, total: int) -> SwaAdmitResult:
        ps = self.page_size
        pos, row = taken.pos, taken.row
        # The matched window has SWA KV (the match is window-valid), and so has every
        # page of the request's own: no check.
        swa = self.alloc.swa_of(row[max(0, pos - self.tree.window) // ps :], checked=False)
        return SwaAdmitResult(pos, row, total, ps, swa)

    def _evict_result(self, out: Freed) -> SwaEvictResult:
        ps = self.page_size
        return SwaEvictResult(out.full * ps, len(out.dead), out.swa * ps, len(out.tombs))

    def sizes(self) -> HybridSizes:
        full, swa = self.pool_sizes()
        t, ps = self.tree, self.page_size
        return HybridSizes(
            **vars(full), swa=swa, tombstones=t.tombstones, tombstone_tokens=t.tombstone_pages * ps
        )
