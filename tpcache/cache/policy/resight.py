"""``resight``: pages seen before live longer, by an amount learned from the traffic.

Why: in prefix-cache traffic most pages are written once and never read again (the
last turn of every conversation, one-off prompts, generated tails), while a page that
was used again is likelier to be used again still. Under LRU the one-offs push out
conversations that come back minutes later. So pages fall into classes by how often
they were seen (``min(sightings, classes - 1)``: 0 for a page cached for the first
time), and each class gets its own lifetime.

How: the eviction key is ``last_access + bonus[class]`` (ties by node id): the bonus is
how much longer the class lives than the shortest-lived one. A node that leaves the
cache is remembered in a ghost (its pages' block hashes, tick of last use and class;
``ghost_factor`` x the capacity in pages), so pages cached again are known as seen
before (the new leaf is split where they end) and their reuse gaps are measured even
though they were evicted. ``LifetimeModel`` turns the measured gaps into the lifetimes
that maximise hits in the capacity, re-solved after every quarter capacity of page
visits. With little room it gives first-seen pages no lifetime (an admission filter in
effect: they fill only the room re-seen pages leave); with much room it keeps one
lifetime for all (plain LRU) unless the classes clearly differ.

Rules it keeps: a logical clock only (ticks of the tree) and statistics that come out
the same on every machine, so every TP rank evicts the same nodes; eviction stays
leaf-only, through the tree's heap, O(log n) per node; per op it adds O(nodes touched)
Python steps, O(pages) vectorised work and, per quarter capacity of visits, one solve
of about a millisecond (and, when the bonuses move by more than an eighth, a rebuild of
the heap). It sees only block hashes, accesses, sizes and ticks, never whether a token
came from a prompt or an output.

Parameters (``ResightParams``): ``ghost_factor`` (default 8: the ghost must remember
pages for as long as re-seen pages may live, and those are a small part of all that is
written), ``classes`` (default 2: first seen, seen before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tpcache.cache.errors import CacheError, IntegrityError
from tpcache.cache.policy.ghost import GhostTable
from tpcache.cache.policy.lifetimes import LifetimeModel

if TYPE_CHECKING:
    from tpcache.cache.tree.node import Node


class ResightTree(Protocol):
    """What the policy reads and asks of the ``RadixTree`` it is attached to."""

    tick: int
    ps: int

    def split(self, child: Node, at: int) -> Node: ...
    def rekey(self) -> None: ...


NAME = "resight"


class InvalidPolicyParams(CacheError, ValueError):
    """Parameters of an eviction policy that are out of range or of the wrong type."""


@dataclass(frozen=True)
class ResightParams:
    """Parameters of ``resight``; the defaults need no tuning per trace.

    ``ghost_factor``: ghost entries per cache page (a number > 0, at most 64).
    ``classes``: sighting classes (an int 2..3; 3 splits "seen twice or more" off).
    """

    ghost_factor: float = 8.0
    classes: int = 2

    def __post_init__(self) -> None:
        g = self.ghost_factor
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 < g <= 64:
            raise InvalidPolicyParams(f"ghost_factor must be a number in (0, 64], got {g!r}")
        c = self.classes
        if isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= 3:
            raise InvalidPolicyParams(f"classes must be an int in [2, 3], got {c!r}")


class ResightPolicy:
    """The state of ``resight`` for one tree: the ghost, the model and the class bonuses.

    Owned by the ``RadixTree`` it is attached to, which calls ``on_match`` before it
    touches a matched path, ``on_insert`` for every new leaf (before queueing it),
    ``on_evict`` with the nodes one eviction removed, and ``reset`` when it is cleared.
    It writes only the ``hits`` of nodes (a page re-admitted from the ghost counts its
    earlier sightings there), splits a new leaf where the pages it had seen before end,
    and, when the bonuses change, has the tree recompute every key (``rekey``), so that
    pages of one class always leave in LRU order. Bonuses change only when the model's
    answer moves by more than an eighth, so that is rare.
    """

    def __init__(self, capacity_pages: int, params: ResightParams | None = None) -> None:
        self.params = params or ResightParams()
        self.k = self.params.classes
        self.ghost = GhostTable(max(1, int(self.params.ghost_factor * capacity_pages)))
        self.model = LifetimeModel(self.k, capacity_pages, halve_every=self.ghost.capacity)
        self.solve_every = max(1, capacity_pages // 4)
        self.tree: ResightTree | None = None
        self.rekeys = 0  # statistics only: how often the bonuses changed
        self.reset()

    def attach(self, tree: ResightTree) -> None:
        self.tree = tree

    def reset(self) -> None:
        """Forget everything (the tree was cleared)."""
        self.ghost.clear()
        self.model.clear()
        self.bonus = [0] * self.k  # ticks of extra lifetime per class (least is 0)
        self.lifetimes: list[int] | None = None  # the model's last answer, None: LRU
        self._tick = 0
        self._since_solve = 0

    def key(self, n: Node) -> tuple[int, ...]:
        """The eviction key: the tick the node's class lifetime runs out, then its id."""
        return (n.last_access + self.bonus[min(n.hits, self.k - 1)], n.id)

    # ---- hooks ------------------------------------------------------------------------
    def on_match(self, path: list[Node], tick: int) -> None:
        """Each node of ``path`` is used at ``tick`` (its ``last_access`` still the old)."""
        if not path:
            return
        self._advance(tick)
        top = self.k - 1
        reuse = self.model.reuse
        seen = [0] * self.k  # pages per class after this use
        for node in path:
            n = node.pages.size
            c = node.hits if node.hits < top else top
            reuse(c, tick - node.last_access, n)
            seen[c + 1 if c < top else top] += n
        for c, n in enumerate(seen):
            if n:
                self._visit(c, n)

    def on_insert(self, node: Node) -> Node:
        """A new leaf: pages the ghost remembers at its start form an upper node of a
        higher class. Returns the leaf (the lower part when split)."""
        tree = self.tree
        assert tree is not None
        tick = tree.tick
        self._advance(tick)
        n = node.pages.size
        m, c = 0, self.k - 1
        for pages, last, cls in self.ghost.take(node.states):
            self.model.reuse(cls, tick - last, pages)
            m += pages
            c = min(c, cls + 1)
        if m:
            upper = node if m == n else tree.split(node, m * tree.ps)
            upper.hits = c
            self._visit(c, m)
        if m < n:
            self._visit(0, n - m)
        return node

    def on_evict(self, nodes: list[Node]) -> None:
        """``nodes`` left the cache: remember their pages in the ghost."""
        top = self.k - 1
        put = self.ghost.put
        for nd in nodes:
            put(nd.states, nd.last_access, min(nd.hits, top))

    # ---- learning ---------------------------------------------------------------------
    def _advance(self, tick: int) -> None:
        if tick > self._tick:
            self.model.advance(tick - self._tick)
            self._tick = tick

    def _visit(self, cls: int, pages: int) -> None:
        self.model.visit(cls, pages)
        self._since_solve += pages
        if self._since_solve >= self.solve_every:
            self._since_solve = 0
            self._solve()

    def _solve(self) -> None:
        lifetimes = self.model.solve()
        self.lifetimes = None if lifetimes is None else lifetimes.tolist()
        if self.lifetimes is None:
            bonus = [0] * self.k
        else:
            low = min(self.lifetimes)
            bonus = [t - low for t in self.lifetimes]
        if any(abs(b - a) * 8 > max(a, b) for a, b in zip(self.bonus, bonus, strict=True)):
            self.bonus = bonus
            self.rekeys += 1
            if self.tree is not None:
                self.tree.rekey()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if the ghost, the model or the bonuses are broken."""
        self.ghost.check_integrity()
        self.model.check_integrity()
        if len(self.bonus) != self.k or min(self.bonus) != 0:
            raise IntegrityError(f"resight: bonuses {self.bonus} (one per class, least 0)")
