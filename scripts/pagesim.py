"""An offline page-level prefix-cache simulator: the reference that tpcache's cache is
measured against on trace replays (``scripts/belady.py`` is its command line). It does
not import ``tpcache.cache`` on purpose: it is a second, independent model.

The replay, one request at a time in trace order, with page size ``P`` (page ids from
``page_replay``: a page is named by its whole prefix):

1. Request ``r`` reuses the longest run of cached pages from the start of its prompt,
   at most ``floor((input_length - 1) / P)`` pages (one prompt token is always
   computed); that many pages times ``P`` are hit tokens.
2. Then every whole page of prompt + output is made cached (admit2-lru: only some, see
   ``_Ghost``); a page already cached is only accessed, and its access time becomes
   ``r``.
3. While the cache holds more than ``capacity // P`` pages, pages not accessed by the
   current request are evicted, by policy. When the current request alone is over the
   capacity, the cache stays over it until the next request.

Policies: ``inf`` (never evict), ``lru`` (oldest access first), ``belady`` (farthest
next use first, never used again before all; a page's next use is the next request
whose reusable prefix contains it), ``admit2-lru`` (LRU, admitting a page on its second
sighting). Ties go to the older access, then to the deeper page.

``tree=True`` is the radix-tree-exact mode: only leaves (pages with no cached child)
are evicted, and admit2-lru admits a page only if its parent is cached or admitted with
it. LRU and Belady never prefer an ancestor to its cached descendant under the tie rule
(see ``_PageCache``), so they give the same figures in both modes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from page_replay import PagedReplay, next_uses

Policy = Literal["inf", "lru", "belady", "admit2-lru"]
POLICIES: tuple[Policy, ...] = ("inf", "lru", "belady", "admit2-lru")
GHOST_FACTOR = 8  # the admit2 ghost remembers 8x the capacity, in pages


@dataclass(frozen=True)
class SimResult:
    """The outcome of one ``simulate`` run."""

    policy: Policy
    capacity_tokens: float  # math.inf when unbounded (always for "inf")
    tree: bool
    page_size: int
    hit_tokens: int
    prompt_tokens: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Ghost:
    """First sightings for admit2-lru: a FIFO of the last ``capacity`` first sightings.

    A sighting of a page that is neither cached nor remembered is a first sighting and
    takes the next FIFO number. A page is remembered while its number is among the last
    ``capacity`` handed out and it has not been admitted since. Admitting a page forgets
    it without freeing its FIFO place, so at most ``capacity`` pages are remembered.
    """

    def __init__(self, num_ids: int, capacity: float) -> None:
        self._number = np.full(num_ids, -1, dtype=np.int64)  # -1: never seen or forgotten
        self._handed = 0
        self._capacity = capacity

    def remembers(self, pages: np.ndarray) -> np.ndarray:
        number = self._number[pages]
        return (number >= 0) & (number >= self._handed - self._capacity)

    def forget(self, pages: np.ndarray) -> None:
        self._number[pages] = -1

    def add(self, pages: np.ndarray) -> None:
        self._number[pages] = self._handed + np.arange(len(pages))
        self._handed += len(pages)


@dataclass(order=True)
class _Run:
    key: tuple[int, int]  # (policy priority, access time); the heap pops the least
    tie: int  # insertion counter, so that the heap never compares arrays
    pages: np.ndarray = field(compare=False)  # deepest first; a path in tree mode


class _PageCache:
    """The cached pages of one simulation and their eviction order.

    The order is a heap of runs, not of pages: a run is the pages one request accessed
    with one policy priority, deepest first. A request's pages form one path, and along
    a path the order never prefers an ancestor to a descendant (an ancestor is accessed
    whenever its descendant is, so its access is no older, and it is next used no
    later), so a run is evicted from its deep end, one heap step per run, not per page.
    A page's only live entry is the run of its last access; entries of pages evicted or
    accessed again since are dropped when their run is popped (lazy invalidation).
    In tree mode, a run whose next page still has a cached child waits in ``_waiting``
    under that page until its last child goes.
    """

    def __init__(self, replay: PagedReplay, capacity_pages: float, tree: bool) -> None:
        self._parent = replay.parent
        self._capacity = capacity_pages
        self._tree = tree
        self.cached = np.zeros(replay.num_ids, dtype=bool)
        self._last = np.full(replay.num_ids, -1, dtype=np.int64)  # access time per page
        self._children = np.zeros(replay.num_ids, dtype=np.int64)  # cached; tree mode only
        self.size = 0
        self.evicted = 0
        self._heap: list[_Run] = []
        self._waiting: dict[int, list[_Run]] = {}
        self._ties = itertools.count()

    def match(self, pages: np.ndarray, limit: int) -> int:
        """How many leading pages of ``pages[:limit]`` are cached. Pure."""
        head = self.cached[pages[:limit]]
        return int(limit) if head.all() else int(head.argmin())

    def access(self, now: int, pages: np.ndarray, priority: np.ndarray | None) -> None:
        """Cache and access ``pages`` (one request's, root first) at time ``now``.

        ``priority`` per page orders eviction before the access time (None: all 0).
        """
        new = pages[~self.cached[pages]]
        self.cached[new] = True
        self.size += len(new)
        if self._tree and len(new):
            parents = self._parent[new]
            parents = parents[parents >= 0]
            assert self.cached[parents].all(), "tree mode cached a page without its parent"
            self._children[parents] += 1  # distinct: one path
        self._last[pages] = now
        if math.isinf(self._capacity) or not len(pages):
            return
        deep_first = pages[::-1]
        if priority is None:
            cuts: list[int] = []
            keys = [0]
        else:
            prio = priority[::-1]
            cuts = (np.flatnonzero(prio[1:] != prio[:-1]) + 1).tolist()
            keys = [int(prio[0])] + [int(prio[c]) for c in cuts]
        for key, run in zip(keys, np.split(deep_first, cuts), strict=True):
            heapq.heappush(self._heap, _Run((key, now), next(self._ties), run))

    def evict(self, now: int) -> None:
        """Evict pages not accessed at ``now`` until the cache fits, or none is left."""
        kept: list[_Run] = []
        while self.size > self._capacity and self._heap:
            run = heapq.heappop(self._heap)
            if run.key[1] == now:  # the current request's pages stay
                kept.append(run)
                continue
            pages = run.pages
            pages = pages[self.cached[pages] & (self._last[pages] == run.key[1])]
            if len(pages):
                self._evict_from(run, pages)
        for run in kept:
            heapq.heappush(self._heap, run)

    def _evict_from(self, run: _Run, pages: np.ndarray) -> None:
        need = int(self.size - self._capacity)
        evictable = len(pages)
        if self._tree:
            assert np.array_equal(self._parent[pages[:-1]], pages[1:]), "run is not a path"
            others = self._children[pages].copy()
            others[1:] -= 1  # the page before in the run is a cached child
            blocked = np.flatnonzero(others)
            evictable = int(blocked[0]) if len(blocked) else len(pages)
        gone = pages[: min(need, evictable)]
        self.cached[gone] = False
        self.size -= len(gone)
        self.evicted += len(gone)
        rest = _Run(run.key, run.tie, pages[len(gone) :])
        if self._tree and len(gone):
            parents = self._parent[gone]
            parents = parents[parents >= 0]
            self._children[parents] -= 1
            top = int(self._parent[gone[-1]])
            if top >= 0 and self._children[top] == 0:
                for waiting in self._waiting.pop(top, []):
                    heapq.heappush(self._heap, waiting)
        if not len(rest.pages):
            return
        if len(gone) == evictable:  # only in tree mode: rest.pages[0] has a cached child
            self._waiting.setdefault(int(rest.pages[0]), []).append(rest)
        else:
            heapq.heappush(self._heap, rest)


def _admit_on_second_sighting(
    cache: _PageCache, ghost: _Ghost, pages: np.ndarray, tree: bool
) -> np.ndarray:
    """Which of ``pages`` (a path, root first) are cached after this sighting."""
    cached = cache.cached[pages]
    seen = ghost.remembers(pages) & ~cached
    if tree:
        ok = cached | seen
        stop = len(ok) if ok.all() else int(ok.argmin())
        keep = np.zeros(len(pages), dtype=bool)
        keep[:stop] = True
        assert not cached[stop:].any(), "tree mode cached a page without its parent"
    else:
        keep = cached | seen
    ghost.forget(pages[keep & ~cached])
    ghost.add(pages[~keep & ~seen])
    return keep


def simulate(
    replay: PagedReplay,
    policy: Policy,
    capacity_tokens: float = math.inf,
    *,
    tree: bool = False,
    next_use: np.ndarray | None = None,
) -> SimResult:
    """Replay ``replay`` through a page cache of ``capacity_tokens`` under ``policy``.

    Pure (builds its own state). ``next_use`` is ``next_uses(replay)``, computed here
    when Belady needs it and it is not given. Raises ``ValueError`` for an unknown policy
    or a negative capacity.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if not capacity_tokens >= 0:
        raise ValueError(f"capacity must be >= 0 tokens, got {capacity_tokens}")
    if policy == "inf":
        capacity_tokens = math.inf
    capacity_pages = (
        math.inf if math.isinf(capacity_tokens) else capacity_tokens // replay.page_size
    )
    if policy == "belady" and next_use is None:
        next_use = next_uses(replay)
    cache = _PageCache(replay, capacity_pages, tree)
    ghost = _Ghost(replay.num_ids, GHOST_FACTOR * capacity_pages)
    hits = 0
    for r in range(replay.num_requests):
        lo, hi = int(replay.offsets[r]), int(replay.offsets[r + 1])
        pages = replay.pages[lo:hi]
        hits += cache.match(pages, int(replay.reuse_limit[r]))
        priority = None
        if policy == "admit2-lru":
            pages = pages[_admit_on_second_sighting(cache, ghost, pages, tree)]
        elif policy == "belady":
            assert next_use is not None
            priority = -next_use[lo:hi]
        cache.access(r, pages, priority)
        cache.evict(r)
    return SimResult(
        policy=policy,
        capacity_tokens=capacity_tokens,
        tree=tree,
        page_size=replay.page_size,
        hit_tokens=hits * replay.page_size,
        prompt_tokens=replay.prompt_tokens,
        evicted_pages=cache.evicted,
    )
