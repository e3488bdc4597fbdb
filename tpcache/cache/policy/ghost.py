"""A ghost list: runs of pages that left the cache lately, kept as block hashes, no KV.

A policy asks it whether pages it is about to cache were seen before, when they were
last used and in which class. Pages leave the cache a node at a time, and come back as
the pages after a cached prefix, so the ghost keeps whole runs: an evicted node's chain
states (the node's own array, no copy), keyed by the chain state of its first page,
with its last-use tick and class. A lookup walks runs from the first new page: one dict
probe per run and one vectorised compare of chain states (equal states mean equal
prefixes). So the work per op is O(runs touched) Python steps, not a step per page. A
run that comes back only in part keeps its remainder, keyed by the remainder's first
page. A page inside a run is found only by a lookup that reaches the run's start.

Bounded by pages: when it holds more than ``capacity`` pages, the runs stored longest
ago go first. Iteration order is insertion order (an ``OrderedDict``), so the content
depends only on the order of the calls: the same in every process. Fields are owned by
this class alone.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from tpcache.cache.errors import IntegrityError


class GhostTable:
    """Remembers up to ``capacity`` pages of evicted runs."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        # first page's chain state -> (states of the run, tick of last use, class)
        self._runs: OrderedDict[int, tuple[np.ndarray, int, int]] = OrderedDict()
        self.pages = 0

    def __len__(self) -> int:
        return self.pages

    def put(self, states: np.ndarray, tick: int, cls: int) -> None:
        """Remember a run of pages (chain ``states``) last used at ``tick``."""
        if not states.size:
            return
        key = int(states[0])
        old = self._runs.pop(key, None)
        if old is not None:
            self.pages -= old[0].size
        self._runs[key] = (states, tick, cls)
        self.pages += states.size
        while self.pages > self.capacity:
            _, (gone, _, _) = self._runs.popitem(last=False)
            self.pages -= gone.size

    def take(self, states: np.ndarray) -> list[tuple[int, int, int]]:
        """How many leading pages of ``states`` were remembered, run by run: a list of
        (pages, tick, class), in order. Those pages are forgotten (cached again)."""
        out: list[tuple[int, int, int]] = []
        pos, n = 0, states.size
        runs = self._runs
        while pos < n:
            run = runs.pop(int(states[pos]), None)
            if run is None:
                break
            have, tick, cls = run
            self.pages -= have.size
            m = min(have.size, n - pos)
            eq = have[:m] == states[pos : pos + m]
            same = m if eq.all() else int(eq.argmin())
            out.append((same, tick, cls))
            if same < have.size:  # the rest of the run stays remembered (a copy: no pin)
                self.put(have[same:].copy(), tick, cls)
                break
            pos += same
        return out

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the page count and the keys are right."""
        total = 0
        for key, (states, tick, cls) in self._runs.items():
            if not states.size or int(states[0]) != key or tick < 0 or cls < 0:
                raise IntegrityError(f"ghost: run {key:#x} is empty or misfiled")
            total += states.size
        if total != self.pages or total > self.capacity:
            raise IntegrityError(
                f"ghost: runs hold {total} pages, counter {self.pages}, capacity {self.capacity}"
            )
