"""``SwaSlots``: the sliding-window part of ``HybridCache`` (``cache.swa``, the
``parts.SwaPart`` calls): which SWA-pool slots pair with full-pool ones, what a
request's forward reads and writes in the SWA pool, and which pages lost their SWA KV.

A view: it reads the cache's paired allocator, windowed tree and request table (the
table is the cache's current one, which a reset replaces) and changes nothing.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tpcache.cache.errors import AllocatorError, InvalidSlots
from tpcache.cache.keys import TokenLike, as_slots, pages_to_slots
from tpcache.cache.records import RequestId
from tpcache.cache.reqtable import ReqTable
from tpcache.cache.swa.allocator import PairedAllocator
from tpcache.cache.swa.tree import SwaTree


class Windowed(Protocol):
    """The hybrid cache as its SWA part reads it (named by shape: no import of it)."""

    page_size: int
    alloc: PairedAllocator
    tree: SwaTree
    reqs: ReqTable


class SwaSlots:
    """The SWA calls of a cache with a full and an SWA pool (``parts.SwaPart``). Owns
    nothing: ``cache`` is the one it was made for."""

    def __init__(self, cache: Windowed) -> None:
        self.cache = cache

    @property
    def window(self) -> int:
        return self.cache.tree.window

    def slots(self, slots: TokenLike) -> np.ndarray:
        alloc, ps = self.cache.alloc, self.cache.page_size
        slot_ids = as_slots(slots, None, alloc.num_pages * ps)
        try:
            swa = alloc.swa_of(slot_ids // ps)
        except AllocatorError as exc:
            raise InvalidSlots(str(exc)) from None
        return swa.astype(np.int64) * ps + slot_ids % ps

    def request_slots(self, rid: RequestId, start: int) -> tuple[int, np.ndarray]:
        cache = self.cache
        req = cache.reqs.get(rid)
        if not isinstance(start, int) or not 0 <= start <= req.num_tokens:
            raise InvalidSlots(
                f"start {start!r} is outside request {req.rid!r}'s 0..{req.num_tokens}"
            )
        swa_start = max(0, start - cache.tree.window)
        slots = pages_to_slots(req.pages, cache.page_size, req.num_tokens)
        return swa_start, self.slots(slots[swa_start:])

    def tombstoned_pages(self, pages: TokenLike) -> int:
        alloc = self.cache.alloc
        full = as_slots(pages, None, alloc.num_pages)
        return int((~alloc.has_swa(full)).sum())
