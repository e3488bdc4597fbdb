"""A ghost list: which pages were in the cache lately, keyed by block hash, with no KV.

A policy asks it whether a page it is about to cache was seen before and when. It is
a set-associative table of ``sets x WAYS`` entries in numpy arrays: a page's set comes
from the low bits of its mixed block hash, and a full set drops the entry with the
oldest tick (the page least recently used when it left the cache). So lookups and
stores are O(1) vectorised work per page, memory is fixed (16 bytes an entry), and the
content depends only on the order of the calls: the same in every process.

Entries: ``tag`` (the mixed block hash, 0 = empty slot) and ``val`` (``tick * 4 +
class`` of the page when it was last used; -1 = empty). Owned by this class alone.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.errors import IntegrityError
from tpcache.cache.hashing import fmix64

WAYS = 4
CLASS_BITS = 2  # val = tick << CLASS_BITS | class
_CLASS_MASK = (1 << CLASS_BITS) - 1


class GhostTable:
    """Remembers up to about ``entries`` pages (rounded up to whole sets of ``WAYS``)."""

    def __init__(self, entries: int) -> None:
        sets = 1
        while sets * WAYS < entries:
            sets *= 2
        self.sets = sets
        self._tag = np.zeros((sets, WAYS), dtype=np.uint64)
        self._val = np.full((sets, WAYS), -1, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return self.sets * WAYS

    def __len__(self) -> int:
        return int((self._val >= 0).sum())

    def clear(self) -> None:
        self._tag[:] = 0
        self._val[:] = -1

    def _tags(self, states: np.ndarray) -> np.ndarray:
        tags = fmix64(states)
        tags[tags == 0] = 1  # 0 marks an empty slot
        return tags

    def take(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Look up the pages with chain ``states`` and forget those found (they are being
        cached again). Returns (found mask, their ticks, their classes); ticks and classes
        are 0 where not found."""
        tags = self._tags(states)
        rows = (tags & np.uint64(self.sets - 1)).astype(np.int64)
        eq = self._tag[rows] == tags[:, None]
        found = eq.any(axis=1)
        way = eq.argmax(axis=1)
        val = np.where(found, self._val[rows, way], 0)
        if found.any():
            r, w = rows[found], way[found]
            self._tag[r, w] = 0
            self._val[r, w] = -1
        return found, val >> CLASS_BITS, val & _CLASS_MASK

    def put(self, states: np.ndarray, ticks: np.ndarray, classes: np.ndarray) -> None:
        """Remember pages that leave the cache, with the tick of their last use and their
        class (0..3). A page already remembered is updated in place; otherwise the entry
        with the oldest tick of its set goes. Pages are stored in order, so with two in
        one set the later one's choice sees the earlier one's store."""
        tags = self._tags(states)
        rows = (tags & np.uint64(self.sets - 1)).astype(np.int64)
        vals = (ticks.astype(np.int64) << CLASS_BITS) | classes.astype(np.int64)
        todo = np.arange(tags.size)
        while todo.size:
            # One store per set per round, so the fancy-indexed writes never collide.
            _, first = np.unique(rows[todo], return_index=True)
            first.sort()
            now, todo = todo[first], np.delete(todo, first)
            r, t = rows[now], tags[now]
            eq = self._tag[r] == t[:, None]
            way = np.where(eq.any(axis=1), eq.argmax(axis=1), self._val[r].argmin(axis=1))
            self._tag[r, way] = t
            self._val[r, way] = vals[now]

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless empty slots agree and no set holds a tag twice."""
        empty_tag, empty_val = self._tag == 0, self._val < 0
        if (empty_tag != empty_val).any():
            raise IntegrityError("ghost: a slot is empty in its tag but not its value, or back")
        srt = np.sort(self._tag, axis=1)
        if ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != 0)).any():
            raise IntegrityError("ghost: a set holds the same page twice")
