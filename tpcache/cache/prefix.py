"""``PrefixCache``: the cache state machine, written once for every cache kind.

It joins a page allocator, the radix tree and the request-to-slot table, and runs the
tree-level calls (match, insert, lock, evict) and the request lifecycle (admit, extend,
cache_unfinished, finish, abort) over them. A cache kind is it with its parts, not a
second copy: its pools (``pool_names``; per-pool figures come back as tuples in that
order), its tree (``RadixTree``; ``SwaTree`` adds the window), what its handles and
results carry, and the parts it is built with (``parts.py``): the sliding window
(``cache.swa``) or the host tier (``cache.host``, with ``HostCache``'s steps of an
admit and a lifecycle), ``None`` where it has none. ``RadixCache`` (one pool),
``HybridCache`` (full + SWA) and ``HostCache`` (one pool and a host tier) implement
``protocol.Cache``. The same op sequence gives the same tree, slot ids and digest in
every process. Every public method validates its input before it changes anything and
raises a ``CacheError`` subclass otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import HELD, LENT
from tpcache.cache.errors import NoSwaPool, OutOfCapacity
from tpcache.cache.events import AllBlocksCleared, KVEvent
from tpcache.cache.keys import (
    TokenLike,
    as_slots,
    as_tokens,
    check_sign,
    join_pages,
    pages_to_slots,
    slots_to_pages,
)
from tpcache.cache.parts import HostPart, SwaPart
from tpcache.cache.protocol import Evictor
from tpcache.cache.records import AdmitResult, CacheSizes, EvictResult, MatchResult, RequestId
from tpcache.cache.reqtable import (
    Asked,
    Beyond,
    Locked,
    ReqTable,
    Taken,
    admitted_length,
    as_priority,
    check_count,
    check_extends,
    extended_length,
    finished_tail,
    row_slots,
)
from tpcache.cache.room import Room
from tpcache.cache.tallies import cache_digest, pool_sizes
from tpcache.cache.tree.anchors import insert_start, lent_insert_start, match_in
from tpcache.cache.tree.check import check_cache
from tpcache.cache.tree.handles import HandleLocks
from tpcache.cache.tree.insert import insert_key
from tpcache.cache.tree.node import Match, pages_of

if TYPE_CHECKING:
    from tpcache.cache.records import CacheStats, Handle, RequestRow


class PrefixCache:
    """A paged radix prefix cache: allocator, tree, running-request table and handles.

    ``alloc``, ``tree``, ``reqs`` and ``handles`` are owned here and changed only through
    these methods (the digest and ``check_integrity`` read them); so is ``_room``. A kind
    gives ``pool_names``, its allocator and tree, its results (``_match_result``,
    ``_admit_result``, ``_evict_result``, ``sizes``: ``OnePoolCache``'s,
    ``HybridCache``'s) and its parts: ``swa`` and ``host`` stay ``None`` unless the kind
    sets them, once, in its constructor.
    """

    pool_names: tuple[str, ...] = ("full",)
    swa: SwaPart | None = None  # the sliding window (``HybridCache`` sets it)
    host: HostPart | None = None  # the host tier (``HostCache`` sets it)

    def __init__(self, config: Any, alloc: Any, tree: Any) -> None:
        self.config = config
        self.page_size = config.page_size
        self.alloc = alloc
        self.tree = tree
        self.reqs = ReqTable()
        self.handles = HandleLocks(tree)
        self._limit = config.request_limit  # read on every admit and extend
        # How admit and extend make room; it keeps the last eviction ask (``eviction_ask``).
        self._room = Room(alloc, tree, self.page_size, self.pool_names)

    @property
    def num_pools(self) -> int:
        return len(self.pool_names)

    # ---- tree-level operations (the contracts of every public method: ``protocol.Cache``) --
    def admit_prefix_len(self, tokens: TokenLike, namespace: Any = None) -> int:
        key = as_tokens(tokens)
        ps = self.page_size
        return match_in(self.tree, key, (key.size - 1) // ps * ps, namespace)[1].end

    def match_prefix(self, tokens: TokenLike, namespace: Any = None) -> MatchResult:
        key = as_tokens(tokens, defer_sign=True)
        tree = self.tree
        _, found = match_in(tree, key, key.size // self.page_size * self.page_size, namespace)
        check_sign(key, found.end)
        path, pos = tree.split_match(*found)
        tree.touch(path)
        return self._match_result(path, pos)

    def insert(
        self, tokens: TokenLike, slots: TokenLike, priority: int = 0, namespace: Any = None
    ) -> int:
        key, pages, prio, start = self._insert_args(tokens, slots, priority, namespace)
        return insert_key(self.tree, key, pages, prio, owner=LENT, start=start)[0]

    def _insert_args(
        self, tokens: TokenLike, slots: TokenLike, priority: int, namespace: Any
    ) -> tuple[np.ndarray, np.ndarray, int, Any]:
        """``insert``'s arguments checked, in the order its errors are raised: the whole
        pages of ``tokens``, their lent pages, the priority and the node the walk starts
        from (``lent_insert_start``). Shared with the host tier's ``insert``."""
        key = as_tokens(tokens)
        slot_ids = as_slots(slots, key.size, self.alloc.num_pages * self.page_size)
        n = key.size // self.page_size * self.page_size
        pages = slots_to_pages(slot_ids[:n], self.page_size)
        prio = as_priority(priority)
        return key[:n], pages, prio, lent_insert_start(self.tree, namespace, pages)

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        check_count(num_tokens, "alloc_slots' num_tokens")
        pages = self.alloc.alloc(-(-num_tokens // self.page_size), LENT)
        return pages_to_slots(pages, self.page_size, num_tokens)

    def free_slots(self, slots: TokenLike) -> None:
        slot_ids = as_slots(slots, None, self.alloc.num_pages * self.page_size)
        self.alloc.free(slots_to_pages(slot_ids, self.page_size), LENT)

    def lock(self, handle: Handle) -> None:
        self.handles.lock(handle)

    def unlock(self, handle: Handle) -> None:
        self.handles.unlock(handle)

    def evict(self, num_tokens: int, swa_tokens: int = 0) -> EvictResult:
        check_count(num_tokens, "evict's num_tokens")
        check_count(swa_tokens, "evict's swa_tokens")
        if swa_tokens and self.tree.window is None:
            raise NoSwaPool("swa_tokens needs an SWA pool (the hybrid cache)")
        ps = self.page_size
        return self._evict_result(self.tree.evict(-(-num_tokens // ps), -(-swa_tokens // ps)))

    # ---- eviction as the lockstep asks for it (one entry per pool) ------------------------
    @property
    def eviction_ask(self) -> tuple[int, ...]:
        return self._room.ask

    def evictable_pages(self) -> tuple[int, ...]:
        return tuple(c - p for c, p in self.tree.pool_pages())

    def evict_pages(self, asks: tuple[int, ...]) -> tuple[int, ...]:
        out = self.tree.evict(asks[0], asks[1] if len(asks) > 1 else 0)
        return (out.full, out.swa)[: self.num_pools]

    def eviction_marks(self) -> tuple[int, ...]:
        return self.tree.evicted()

    # ---- request lifecycle (the contracts: ``protocol.Cache``) ----------------------------
    def admit(
        self,
        rid: RequestId,
        tokens: TokenLike,
        priority: int = 0,
        *,
        evict: bool | Evictor = True,
        reserve: int = 0,
        namespace: Any = None,
    ) -> AdmitResult:
        rid = self.reqs.check_new(rid)
        key = as_tokens(tokens, copy=True, defer_sign=True)  # the row keeps it (if mutable)
        prio = as_priority(priority)
        asked = Asked(rid, key, prio, admitted_length(key.size, reserve, self._limit))
        self._room.ask = self._room.no_ask
        return self._admit(asked, evict, namespace)

    def _admit(self, a: Asked, evict: bool | Evictor, namespace: Any) -> AdmitResult:
        """``admit`` of inputs checked before anything changed: match, make room, lock,
        take the pages (``_take_row``: the host tier loads what it matched there)."""
        rid, key, prio, total = a
        ps = self.page_size
        tree = self.tree
        space, found = match_in(tree, key, (key.size - 1) // ps * ps, namespace)
        check_sign(key, found.end)
        (path, pos, partial, common), beyond = self._cut(found)
        need = -(-total // ps) - (pos + common) // ps  # what lies beyond included
        if need > self.alloc.num_free:
            self._room.check(need, path, partial, common, evict)
        path, pos = tree.split_match(path, pos, partial, common)
        node = path[-1] if path else tree.root
        top = None if tree.window is None else tree.boundary(node)  # where SWA locks stop
        tree.lock(node, top)
        taken = self._take_row(Locked(path, pos, node, top), need, evict, beyond)
        mark = 0 if top is None else tree.mark_of(top)
        self.reqs.add(rid, key, taken.row, total, taken.pos // ps, taken.node, prio, mark, space)
        return self._admit_result(rid, taken, total)

    # ---- the admit's steps a tier adds to (the host tier: ``host_cache.py``) --------------
    def _cut(self, found: Match) -> tuple[Match, Beyond]:
        """The match an admit locks, and what it matched beyond (none here)."""
        return found, ([], None, 0)

    def _take_row(self, locked: Locked, need: int, evict: bool | Evictor, beyond: Beyond) -> Taken:
        """Take the ``need`` pages an admit ``locked`` its match for; on ``OutOfCapacity``
        unlock and raise."""
        path, pos, node, top = locked
        tree = self.tree
        tree.touch(path, queue=False)
        try:
            pages = self._room.take(need, evict)
        except OutOfCapacity:
            tree.unlock(node, top)
            raise
        return Taken(join_pages([*map(pages_of, path), pages]), node, pos, 0)

    def extend(self, rid: RequestId, n: int, *, evict: bool | Evictor = True) -> np.ndarray:
        req = self.reqs.get(rid)
        end = extended_length(req, n, self._limit)
        room = self._room
        room.ask = room.no_ask
        ps = self.page_size
        need = -(-end // ps) - req.pages.size
        if need > self.alloc.num_free:
            room.check(need, [], None, 0, evict)
        if need or callable(evict):
            req.pages = join_pages((req.pages, room.take(need, evict)))
        start, req.num_tokens = req.num_tokens, end
        self._row_changed(req)
        return row_slots(req, start, end, ps)

    def cache_unfinished(self, rid: RequestId, tokens: TokenLike) -> int:
        req = self.reqs.get(rid)
        key = as_tokens(tokens, copy=True)  # the row keeps it
        check_extends(rid, req.tokens, key, req.num_tokens)
        ps = self.page_size
        n = key.size // ps * ps
        tree = self.tree
        # The row's prefix is the locked path to req.node, so the walk starts there.
        start_pos = req.cached_pages * ps
        _, tree_pages, node = insert_key(
            tree,
            key[:n],
            req.pages[: n // ps],
            req.priority,
            start=self._walk_start(req, key[:n], req.pages[: n // ps], start_pos),
            start_pos=start_pos,
            trusted=True,
        )
        req.pages[: tree_pages.size] = tree_pages
        top = None if tree.window is None else tree.boundary(node)
        tree.lock(node, top)
        tree.unlock(req.node, tree.find_top(req.node, req.mark) if req.mark else None)
        req.node = node
        req.cached_pages = tree_pages.size
        req.tokens = key
        req.mark = 0 if top is None else tree.mark_of(top)
        self._row_changed(req)
        return n

    def finish(self, rid: RequestId, output_tokens: TokenLike = ()) -> int:
        req = self.reqs.get(rid)
        out = as_tokens(output_tokens, allow_empty=True)
        ps = self.page_size
        tail, pages, n = finished_tail(req, out, ps)
        start = self._walk_start(req, tail, pages, 0)
        insert_key(
            self.tree, tail, pages, req.priority, start=start, trusted=True, want_pages=False
        )
        if n // ps < req.pages.size:  # a partial last page (or pages past the output)
            self.alloc.free(req.pages[n // ps :], HELD, checked=False)
        self._release(req)
        return n

    def abort(self, rid: RequestId) -> None:
        req = self.reqs.get(rid)
        self.alloc.free(req.pages[req.cached_pages :], HELD, checked=False)
        self._release(req)

    # ---- what a kind adds to the lifecycle (the host tier: ``host_cache.py``) -------------
    def _walk_start(self, req: Any, key: np.ndarray, pages: np.ndarray, start_pos: int) -> Any:
        """Where caching ``key`` (the row's ``pages``) for ``req`` starts walking: its
        locked node, which ends at ``key[:start_pos]`` (its namespace's anchor, made if
        the walk goes below a default-namespace root)."""
        return insert_start(self.tree, req.node, req.space, key.size > start_pos)

    def _row_changed(self, req: Any) -> None:
        """``req``'s row has new pages (extend) or tree pages (cache_unfinished)."""

    def _release(self, req: Any) -> None:
        """``req`` is done (finished or aborted): unlock its path and forget it."""
        tree = self.tree
        tree.unlock(req.node, tree.find_top(req.node, req.mark) if req.mark else None)
        self.reqs.remove(req.rid)

    # ---- whole-cache ------------------------------------------------------------------------
    def reset(self) -> None:
        events = self.tree.events
        self.alloc.reset()
        self.tree.clear()
        self.reqs = ReqTable()
        self.handles = HandleLocks(self.tree)
        self._room.ask = self._room.no_ask
        if self.config.record_events:
            events.append(AllBlocksCleared())
        self.tree.events = events

    def pool_sizes(self) -> tuple[CacheSizes, ...]:
        return pool_sizes(self)

    def digest(self) -> int:
        return cache_digest(self)

    def check_integrity(self) -> None:
        check_cache(self)

    def request_row(self, rid: RequestId) -> RequestRow:
        return self.reqs.row(rid, self.page_size)

    def running_ids(self) -> list[RequestId]:
        return self.reqs.ids()

    def is_running(self, rid: object) -> bool:
        return rid in self.reqs

    def stats(self) -> CacheStats:
        return self.tree.stats()

    def evict_seconds(self, last: int | None = None) -> list[float]:
        seconds = self.tree.evict_seconds
        if last is None:
            return list(seconds)
        return seconds[max(0, len(seconds) - check_count(last, "last")) :]

    def take_events(self) -> list[KVEvent]:
        events, self.tree.events = self.tree.events, []
        return events

    def put_back_events(self, events: list[KVEvent]) -> None:
        self.tree.events[:0] = events
