"""How long to keep each class of page: lifetimes chosen from measured reuse gaps.

Every page visit starts an interval that ends when the page is used again (a reuse, at
some gap in ticks) or never. ``LifetimeModel`` counts, per class, the pages that start
an interval and the gaps of those that are reused (half-octave bins: 0, 1, 2, 3, 4, 6,
8, 12, ...). If pages of class ``c`` were kept ``T`` ticks after each visit, they would
be hit for every gap below ``T`` and take ``sum(min(gap, T))`` page-ticks of room.
``solve`` picks the lifetimes, one per class, that maximise the hits within the room
the cache had over the same window (capacity x ticks). It searches the whole grid
rather than equalising marginal gains, because a class's hit curve is not concave:
conversations come back after minutes, not at once, so a short lifetime is worth
nothing and a long one a lot.

Censoring: an interval that began less than ``T`` ticks ago may still end in a reuse
below ``T``, so the curve at ``T`` is estimated from the intervals that began at least
``T`` ticks ago only (snapshots of the counters, taken at every solve, tell which), then
scaled to all visits. Without that, a young cache would think nothing is ever reused.

Where the classes hardly differ the estimates are noise, so unless the best choice
promises ``MARGIN`` more hits than one lifetime for all (LRU), the answer is LRU.

Counts are integers (halved together every ``halve_every`` visits, so the window
forgets old traffic); the curves use elementwise float64 operations and integer sums
only, which IEEE 754 makes the same on every machine, so every rank solves alike.
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
MAX_SNAPSHOTS = 256
STEPS = 8  # lifetimes tried per bin for all classes but the last
MARGIN = 0.05  # the model must promise 5% more hits than one lifetime for all (LRU)
_BELOW = np.tri(NUM_BINS, NUM_BINS, -1, dtype=bool)  # [j, b]: bin b lies below edge j


class LifetimeModel:
    """Per-class visit counts and reuse-gap histograms over a decaying window.

    Fields are owned by this class: the counts per class ``c`` of pages that started an
    interval, of pages reused at a gap in bin ``b`` and of those gaps summed (page-ticks)
    (Python ints on the hot path; ``visits``, ``reuses``, ``gap_sum`` give them as int64
    arrays), ``ticks`` (ticks elapsed), all halved together with the snapshots; ``now``
    (the tick, not halved).
    """

    def __init__(self, num_classes: int, capacity_pages: int, halve_every: int) -> None:
        assert num_classes >= 1 and capacity_pages >= 1 and halve_every >= 1
        self.k = num_classes
        self.capacity = capacity_pages
        self.halve_every = halve_every
        self.clear()

    def clear(self) -> None:
        k = self.k
        self._visits = [0] * k
        self._reuses = [0] * (k * NUM_BINS)  # [c * NUM_BINS + b]
        self._gaps = [0] * (k * NUM_BINS)
        self.ticks = 0
        self.now = 0
        self._since_halving = 0
        # Snapshots, oldest first, the first ``_n`` rows: tick and copies of the counters.
        self._snap_tick = np.zeros(2 * MAX_SNAPSHOTS, dtype=np.int64)
        self._snap_v = np.zeros((2 * MAX_SNAPSHOTS, k), dtype=np.int64)
        self._snap_r = np.zeros((2 * MAX_SNAPSHOTS, k, NUM_BINS), dtype=np.int64)
        self._snap_g = np.zeros((2 * MAX_SNAPSHOTS, k, NUM_BINS), dtype=np.int64)
        self._n = 0
        self.snapshot()

    @property
    def visits(self) -> np.ndarray:
        return np.array(self._visits, dtype=np.int64)

    @property
    def reuses(self) -> np.ndarray:
        return np.array(self._reuses, dtype=np.int64).reshape(self.k, NUM_BINS)

    @property
    def gap_sum(self) -> np.ndarray:
        return np.array(self._gaps, dtype=np.int64).reshape(self.k, NUM_BINS)

    def advance(self, ticks: int) -> None:
        self.ticks += ticks
        self.now += ticks

    def visit(self, cls: int, pages: int) -> None:
        """``pages`` pages of class ``cls`` start an interval."""
        self._visits[cls] += pages
        self._since_halving += pages
        if self._since_halving >= self.halve_every:
            self._since_halving = 0
            self.ticks >>= 1
            for counts in (self._visits, self._reuses, self._gaps):
                counts[:] = [x >> 1 for x in counts]
            n = self._n
            for arr in (self._snap_v, self._snap_r, self._snap_g):
                arr[:n] >>= 1

    def reuse(self, cls: int, gap: int, pages: int) -> None:
        """``pages`` pages of class ``cls`` are used again ``gap`` ticks after their last use."""
        i = cls * NUM_BINS + bisect.bisect_right(_EDGES, gap) - 1
        self._reuses[i] += pages
        self._gaps[i] += gap * pages

    def snapshot(self) -> None:
        """Remember the counters as of now (the censoring estimate reads them back)."""
        n = self._n
        if n and self._snap_tick[n - 1] == self.now:
            n -= 1
        if n == 2 * MAX_SNAPSHOTS:  # keep the newer half: amortised O(1) per snapshot
            for arr in (self._snap_tick, self._snap_v, self._snap_r, self._snap_g):
                arr[:MAX_SNAPSHOTS] = arr[MAX_SNAPSHOTS:]
            n = MAX_SNAPSHOTS
        self._snap_tick[n] = self.now
        self._snap_v[n] = self.visits
        self._snap_r[n] = self.reuses
        self._snap_g[n] = self.gap_sum
        self._n = n + 1

    def curves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class ``c`` and lifetime ``T = lower edge of bin j``: the pages that would be
        hit and the page-ticks of room they would take over the window, float64 arrays
        of shape (k, NUM_BINS); and the lifetimes ``T``.

        Estimated from the intervals that began at least ``T`` ticks ago (those with a
        reuse in bin ``b`` are known once ``T`` ticks have passed plus the bin's lower
        edge), scaled to all visits; past the history, no further reuse is assumed."""
        n = self._n
        ticks = self._snap_tick[:n]
        # Only lifetimes within the snapshots' history can be measured (the rest: below).
        nb = max(1, int(np.searchsorted(_LOWER, self.now - ticks[0], side="right")))
        lower = _LOWER[:nb]
        start = self.now - lower  # intervals that began by then are old enough for T
        i = np.searchsorted(ticks, start, side="right") - 1  # -1: before any snapshot
        old = np.zeros((self.k, NUM_BINS), dtype=np.int64)
        old[:, :nb] = np.where(i[:, None] >= 0, self._snap_v[np.maximum(i, 0)], 0).T
        # Reuses in bin b of those intervals were all seen by start + lower edge of b.
        si = np.searchsorted(ticks, start[:, None] + lower[None, :], side="right") - 1
        keep = ((si >= 0) & _BELOW[:nb, :nb])[:, :, None]  # (j, b, 1)
        si = np.maximum(si, 0)
        bins = np.arange(nb)[None, :]
        hit_old = np.zeros_like(old)
        gap_old = np.zeros_like(old)
        hit_old[:, :nb] = np.where(keep, self._snap_r[si, :, bins], 0).sum(axis=1).T  # (k, j)
        gap_old[:, :nb] = np.where(keep, self._snap_g[si, :, bins], 0).sum(axis=1).T
        hit_old = np.minimum(hit_old, old)
        safe = np.maximum(old, 1).astype(np.float64)
        hit_frac = hit_old / safe
        room_per = (gap_old + (old - hit_old) * _LOWER[None, :]) / safe
        # Past the history (too few intervals that old): no more reuse, room grows with T.
        known = old >= np.maximum(self.visits[:, None] >> 4, 1)
        known[:, nb:] = False
        known[:, 0] = True
        last = np.maximum.accumulate(np.where(known, np.arange(NUM_BINS)[None, :], 0), axis=1)
        frac_last = np.take_along_axis(hit_frac, last, axis=1)
        room_last = np.take_along_axis(room_per, last, axis=1)
        hit_frac = frac_last
        room_per = room_last + (1.0 - frac_last) * (_LOWER[None, :] - _LOWER[last])
        v = self.visits[:, None].astype(np.float64)
        return hit_frac * v, room_per * v, _LOWER

    def solve(self) -> np.ndarray | None:
        """Lifetimes (ticks, one per class) that maximise hits in ``capacity * ticks``
        page-ticks, or ``None`` if there is no data yet or keeping every page for the
        whole history would fit (nothing to choose). Takes a snapshot first.

        The classes but the last try lifetimes up to the history's length, each bin cut
        in ``STEPS`` (curves interpolated inside a bin, as if its gaps were spread
        evenly), every combination; the last class gets the rest of the room, also
        interpolated. Ties go to the shorter lifetimes of the lower classes. Unless that
        promises ``MARGIN`` more hits than one lifetime for all classes (LRU), LRU it is:
        the estimates are noisy, and where classes hardly differ they would only make
        the order flicker."""
        self.snapshot()
        if self.ticks <= 0 or not self.visits.any():
            return None
        hits, room, lower = self.curves()
        budget = float(self.capacity * self.ticks)
        history = int(np.searchsorted(lower, self.now, side="right")) - 1
        if room[:, history].sum() <= budget:  # keeping every page all along would fit
            return None
        # Candidate lifetimes of the other classes: STEPS per bin, up to the history.
        jj = np.repeat(np.arange(history + 1), STEPS)[: history * STEPS + 1]
        ff = np.tile(np.arange(STEPS) / STEPS, history + 1)[: jj.size]
        nxt = np.minimum(jj + 1, NUM_BINS - 1)
        cand_t = lower[jj] + ff * (lower[nxt] - lower[jj])
        grid_hits = np.zeros(1)
        grid_room = np.zeros(1)
        lru_hits = np.zeros(cand_t.size)
        lru_room = np.zeros(cand_t.size)
        for c in range(self.k):
            h = hits[c][jj] + ff * (hits[c][nxt] - hits[c][jj])
            r = room[c][jj] + ff * (room[c][nxt] - room[c][jj])
            lru_hits += h
            lru_room += r
            if c < self.k - 1:
                grid_hits = (grid_hits[:, None] + h[None, :]).reshape(-1)
                grid_room = (grid_room[:, None] + r[None, :]).reshape(-1)
        # LRU in this model: one lifetime for all, the longest that fits.
        lru = max(int(np.searchsorted(np.maximum.accumulate(lru_room), budget, "right")) - 1, 0)
        j, frac, ok = _last_class(room[-1], budget - grid_room)
        last_hits = hits[-1]
        total = np.where(
            ok, grid_hits + last_hits[j] + frac * (last_hits[j + 1] - last_hits[j]), -1
        )
        best = int(np.argmax(total))
        if total[best] < lru_hits[lru] * (1 + MARGIN):  # not worth leaving LRU for
            return np.full(self.k, int(cand_t[lru]), dtype=np.int64)
        out = np.empty(self.k, dtype=np.int64)
        rest = best
        for c in range(self.k - 2, -1, -1):
            out[c] = int(cand_t[rest % cand_t.size])
            rest //= cand_t.size
        width = int(lower[j[best] + 1] - lower[j[best]])
        out[-1] = int(lower[j[best]]) + int(frac[best] * width)
        return out

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` on a negative count or snapshots out of order."""
        if (self.visits < 0).any() or (self.reuses < 0).any() or (self.gap_sum < 0).any():
            raise IntegrityError("lifetime model: a negative count")
        if self.ticks < 0 or self.ticks > self.now:
            raise IntegrityError(f"lifetime model: {self.ticks} ticks of window at tick {self.now}")
        ticks = self._snap_tick[: self._n]
        if not self._n or (np.diff(ticks) <= 0).any() or ticks[-1] > self.now:
            raise IntegrityError(f"lifetime model: snapshot ticks {ticks[-3:]} out of order")


def _last_class(room: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The last class's lifetime for each amount of room ``left`` by the others: the
    last bin edge ``j`` whose room fits (room grows with T), plus the fraction ``frac``
    of the next bin that the rest of the room pays for; ``ok`` False where not even the
    first edge fits."""
    room = np.maximum.accumulate(room)
    j = np.searchsorted(room, left, side="right") - 1  # -1: does not fit
    ok = j >= 0
    j = np.clip(j, 0, NUM_BINS - 2)
    span = room[j + 1] - room[j]
    frac = np.where(ok & (span > 0), (left - room[j]) / np.maximum(span, 1e-9), 0.0)
    return j, np.clip(frac, 0.0, 1.0), ok
