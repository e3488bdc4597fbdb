"""``Room``: how an admit or an extend makes room for the pages it needs.

Three ways, by the call's ``evict`` argument: ``False``, refuse (``OutOfCapacity``) what
the free pages cannot give; ``True``, evict each pool's shortfall in policy order (and
remember it: ``ask``, the decision a TP rank repeats with ``evict_pages``); an
``Evictor``, hand it the shortfall (the lockstep's agreed eviction, which may be a
collective). The refusal is decided after the match is locked, since a locked path stops
being evictable.
"""

from __future__ import annotations

from operator import add
from typing import Any

import numpy as np

from tpcache.cache.allocator import HELD
from tpcache.cache.protocol import Evictor
from tpcache.cache.reqtable import refuse_room


class Room:
    """Owned by one ``PrefixCache``, over its allocator and tree (the same objects for
    the cache's life, reset included). ``ask`` is owned here: pages per pool the last
    call evicted for, zeros (``no_ask``) if it evicted nothing."""

    def __init__(self, alloc: Any, tree: Any, page_size: int, pool_names: tuple[str, ...]):
        self.alloc = alloc
        self.tree = tree
        self.page_size = page_size
        self.pool_names = pool_names
        self.no_ask = (0,) * len(pool_names)
        self.ask: tuple[int, ...] = self.no_ask

    def check(
        self, need: int, path: list[Any], partial: Any, common: int, evict: bool | Evictor
    ) -> None:
        """Refuse (``OutOfCapacity``) ``need`` pages that some pool cannot give even after
        eviction, once the match ``path`` is locked (its pages stop being evictable)."""
        if callable(evict):
            return
        frees = self.alloc.pool_free()
        room = None
        if evict:
            room = self.tree.evictable_after_lock(path, partial, common)
            if need <= min(map(add, frees, room)):
                return
        refuse_room(need, self.page_size, frees, room, self.pool_names)

    def take(self, need: int, evict: bool | Evictor) -> np.ndarray:
        """``need`` pages (in every pool) after the eviction: a view, valid until the next
        free, that callers copy into the row at once."""
        if callable(evict):
            evict(*self.alloc.shortfall(need))  # may be a collective
        elif evict and need > self.alloc.num_free:
            self.ask = self.alloc.shortfall(need)
            self.tree.evict(*self.ask)
        return self.alloc.alloc(need, HELD, copy=False)
