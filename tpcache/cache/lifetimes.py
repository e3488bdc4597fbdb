"""How long to keep each class of page: lifetimes chosen from measured reuse gaps.

Every page visit starts an interval that ends when the page is used again (a reuse, at
some gap in ticks) or never. ``LifetimeModel`` keeps, per class, the pages that started
an interval and a histogram of the gaps of those that were reused (half-octave bins:
0, 1, 2, 3, 4, 6, 8, 12, 16, ...). If pages of class ``c`` were kept ``T`` ticks after
each visit, they would have been hit for every gap below ``T`` and would have taken
``sum(min(gap, T))`` page-ticks of room. ``solve`` picks the lifetimes, one per class
from the bin edges, that maximise the hits within the room the cache had over the same
window (capacity x ticks). It searches the whole grid rather than equalising marginal
gains, because a class's hit curve is not concave: conversations come back after
minutes, not at once, so a short lifetime is worth nothing and a long one a lot.

All counts are integers (halved together every ``halve_every`` visits, so the window
forgets old traffic); the results are the same on every machine.
"""

from __future__ import annotations

import bisect

import numpy as np

from tpcache.cache.errors import IntegrityError

NUM_BINS = 64  # lower edges reach 3 * 2**30 ticks
_LOWER = np.array(
    [0, 1, 2, 3] + [v for k in range(2, 32) for v in (1 << k, 3 << (k - 1))], dtype=np.int64
)[:NUM_BINS]


_EDGES = _LOWER.tolist()


class LifetimeModel:
    """Per-class visit counts and reuse-gap histograms over a decaying window.

    Fields are owned by this class: ``visits[c]``, ``reuses[c, b]`` (pages reused at a
    gap in bin ``b``), ``gap_sum[c, b]`` (their gaps summed, page-ticks) and ``ticks``
    (ticks elapsed), all int64 and halved together.
    """

    def __init__(self, num_classes: int, capacity_pages: int, halve_every: int) -> None:
        assert num_classes >= 1 and capacity_pages >= 1 and halve_every >= 1
        self.k = num_classes
        self.capacity = capacity_pages
        self.halve_every = halve_every
        self.clear()

    def clear(self) -> None:
        self.visits = np.zeros(self.k, dtype=np.int64)
        self.reuses = np.zeros((self.k, NUM_BINS), dtype=np.int64)
        self.gap_sum = np.zeros((self.k, NUM_BINS), dtype=np.int64)
        self.ticks = 0
        self._since_halving = 0

    def advance(self, ticks: int) -> None:
        self.ticks += ticks

    def visit(self, cls: int, pages: int) -> None:
        """``pages`` pages of class ``cls`` start an interval."""
        self.visits[cls] += pages
        self._since_halving += pages
        if self._since_halving >= self.halve_every:
            self._since_halving = 0
            self.visits >>= 1
            self.reuses >>= 1
            self.gap_sum >>= 1
            self.ticks >>= 1

    def reuse(self, cls: int, gap: int, pages: int) -> None:
        """``pages`` pages of class ``cls`` are used again ``gap`` ticks after their last use."""
        b = bisect.bisect_right(_EDGES, gap) - 1
        self.reuses[cls, b] += pages
        self.gap_sum[cls, b] += gap * pages

    def curves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class and lifetime ``T = lower edge of bin j``: pages hit (reused at a gap
        below ``T``) and page-ticks of room used. Shapes (k, NUM_BINS); ``T`` too."""
        zero = np.zeros((self.k, 1), dtype=np.int64)
        hits = np.concatenate((zero, np.cumsum(self.reuses, axis=1)[:, :-1]), axis=1)
        below = np.concatenate((zero, np.cumsum(self.gap_sum, axis=1)[:, :-1]), axis=1)
        alive = np.maximum(self.visits[:, None] - hits, 0)
        room = below + alive * _LOWER[None, :]
        return hits, room, _LOWER

    def solve(self) -> np.ndarray | None:
        """Lifetimes (ticks, one per class) that maximise hits in ``capacity * ticks``
        page-ticks, or ``None`` if every lifetime fits (nothing to choose) or there is no
        data yet. The classes but the last take lifetimes from the bin edges (every
        combination is tried); the last class gets the rest of the room, interpolated
        inside its bin (gaps spread evenly in a bin). Ties go to the shorter lifetimes
        of the lower classes."""
        if self.ticks <= 0 or not self.visits.any():
            return None
        hits, room, lifetimes = self.curves()
        budget = self.capacity * self.ticks
        if int(room[:, -1].sum()) <= budget:
            return None
        grid_hits = np.zeros(1, dtype=np.int64)
        grid_room = np.zeros(1, dtype=np.int64)
        for c in range(self.k - 1):
            grid_hits = (grid_hits[:, None] + hits[c][None, :]).reshape(-1)
            grid_room = (grid_room[:, None] + room[c][None, :]).reshape(-1)
        left = budget - grid_room
        # The last class: the last edge whose room fits (room grows with T), plus the
        # fraction of the next bin that the rest of the room pays for.
        last_room, last_hits = room[-1], hits[-1]
        j = np.searchsorted(last_room, left, side="right") - 1  # -1: does not fit
        ok = j >= 0
        j = np.clip(j, 0, NUM_BINS - 2)
        span = last_room[j + 1] - last_room[j]
        frac = np.where(ok & (span > 0), (left - last_room[j]) / np.maximum(span, 1), 0.0)
        frac = np.minimum(frac, 1.0)
        extra = np.floor(frac * (last_hits[j + 1] - last_hits[j])).astype(np.int64)
        total = np.where(ok, grid_hits + last_hits[j] + extra, -1)
        best = int(np.argmax(total))
        out = np.empty(self.k, dtype=np.int64)
        rest = best
        for c in range(self.k - 2, -1, -1):
            out[c] = lifetimes[rest % NUM_BINS]
            rest //= NUM_BINS
        width = lifetimes[j[best] + 1] - lifetimes[j[best]]
        out[-1] = lifetimes[j[best]] + int(np.floor(frac[best] * width))
        return out

    def check_integrity(self) -> None:
        if (self.visits < 0).any() or (self.reuses < 0).any() or (self.gap_sum < 0).any():
            raise IntegrityError("lifetime model: a negative count")
        if self.ticks < 0:
            raise IntegrityError(f"lifetime model: {self.ticks} ticks")
