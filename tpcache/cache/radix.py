"""``RadixCache``: the cache state machine every TP rank and the coordinator run.

It joins the page allocator, the radix tree and the request-to-slot table. The same op
sequence gives the same tree, the same slot ids and the same digest in every process.
Every public method validates its input before it changes anything and raises a
``CacheError`` subclass otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpcache.cache.allocator import CACHED, FREE, HELD, LENT, PageAllocator
from tpcache.cache.errors import (
    IntegrityError,
    LockError,
    OutOfCapacity,
    UnknownHandle,
)
from tpcache.cache.events import AllBlocksCleared, KVEvent
from tpcache.cache.hashing import fmix64_int, fold_fields
from tpcache.cache.keys import (
    TokenLike,
    as_slots,
    as_tokens,
    check_sign,
    join_pages,
    pages_to_slots,
    slots_to_pages,
)
from tpcache.cache.policies import make_policy
from tpcache.cache.records import (
    AdmitResult,
    CacheConfig,
    CacheSizes,
    EvictResult,
    Handle,
    MatchResult,
    RequestRow,
    new_owner,
)
from tpcache.cache.reqtable import (
    ReqTable,
    RequestId,
    admitted_length,
    as_priority,
    check_count,
    check_extends,
    extended_length,
    finished_tail,
    row_slots,
)
from tpcache.cache.tree import Node, RadixTree

# Called with the local shortfall in pages; evicts what it decides (see ``admit``).
Evictor = Callable[[int], object]


class RadixCache:
    """A paged radix prefix cache with its allocator and running-request table."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.alloc = PageAllocator(config.num_pages, config.page_size)
        key_fn, hooks = make_policy(config.policy, config.num_pages, config.policy_params)
        self.tree = RadixTree(
            self.alloc,
            key_fn,
            record_events=config.record_events,
            medium=config.medium,
            hooks=hooks,
        )
        self.reqs = ReqTable()
        self._limit = config.request_limit  # read on every admit and extend
        # lock() calls not yet undone, per handle (node id). Owned here: a handle's unlock
        # must never take a lock that a running request holds on the same node.
        self._handle_locks: dict[int, int] = {}
        # Pages per pool the last admit or extend asked the eviction for (its shortfall
        # after the lock): the decision a TP rank repeats (see ``eviction_ask``).
        self._ask: tuple[int] = (0,)
        self._owner = new_owner()  # stamped on the handles this generation gives out

    # ---- tree-level operations ------------------------------------------------------------
    def match_prefix(self, tokens: TokenLike) -> MatchResult:
        """The longest cached prefix of ``tokens`` in whole pages.

        May split a node and advances the access clock; never changes slot ownership.
        """
        key = as_tokens(tokens, defer_sign=True)
        found = self.tree.descend(key, key.size // self.page_size * self.page_size)
        check_sign(key, found[1] + found[3])
        return self._match_result(*self.tree.take_match(*found))

    def _match_result(self, path: list[Node], n: int) -> MatchResult:
        node = path[-1] if path else self.tree.root
        if len(path) > 1:
            pages = join_pages([p.pages for p in path])
        else:  # a copy either way: the caller must not get the tree's own array
            pages = path[0].pages.copy() if path else np.zeros(0, np.int64)
        return MatchResult(n, pages, Handle(node.id, self._owner), self.page_size)

    def insert(self, tokens: TokenLike, slots: TokenLike, priority: int = 0) -> int:
        """Cache the whole pages of ``tokens`` held at ``slots``; returns tokens already cached.

        ``slots`` must be page-laid-out slots allocated by the caller (``alloc_slots``;
        the tree's own slots are accepted for the already-cached part). Slots of the
        already-cached part that differ from the tree's are freed; the slots of a
        partial last page stay the caller's. Raises ``InvalidSlots`` (nothing changed)
        for slots of the wrong count or layout, out of range, or not the caller's.
        """
        key = as_tokens(tokens)
        slot_ids = as_slots(slots, key.size, self.alloc.num_pages * self.page_size)
        n = key.size // self.page_size * self.page_size
        pages = slots_to_pages(slot_ids[:n], self.page_size)
        have, _, _ = self.tree.insert(key[:n], pages, as_priority(priority), owner=LENT)
        return have

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages for ``num_tokens`` tokens, lent to the caller (no eviction).

        The caller gives them back with ``insert`` or ``free_slots``. Raises
        ``OutOfCapacity`` (nothing taken) if not enough pages are free.
        """
        check_count(num_tokens, "alloc_slots' num_tokens")
        pages = self.alloc.alloc(-(-num_tokens // self.page_size), LENT)
        return pages_to_slots(pages, self.page_size, num_tokens)

    def free_slots(self, slots: TokenLike) -> None:
        """Free pages lent by ``alloc_slots``, given by their slots (all slots of each page).

        Raises ``InvalidSlots`` or ``AllocatorError`` (nothing freed) for malformed slots
        or pages not lent to a caller (free, cached, or in a running request's row).
        """
        slot_ids = as_slots(slots, None, self.alloc.num_pages * self.page_size)
        pages = slots_to_pages(slot_ids, self.page_size)
        self.alloc.free(pages, LENT)

    def lock(self, handle: Handle) -> None:
        """Protect the matched prefix of ``handle`` from eviction; locks nest."""
        node = self._node(handle)
        self.tree.lock(node)
        self._handle_locks[node.id] = self._handle_locks.get(node.id, 0) + 1

    def unlock(self, handle: Handle) -> None:
        """Undo one ``lock`` of ``handle``. Raises ``LockError`` if this handle holds no
        lock (a lock a running request holds on the same node does not count),
        ``UnknownHandle`` if it names no node; nothing changes then."""
        node = self._node(handle)
        held = self._handle_locks.get(node.id, 0)
        if held == 0:
            raise LockError(f"handle {node.id} is not locked (by lock())")
        self.tree.unlock(node)
        if held == 1:
            del self._handle_locks[node.id]
        else:
            self._handle_locks[node.id] = held - 1

    def evict(self, num_tokens: int) -> EvictResult:
        """Evict whole unlocked leaves in policy order until ``num_tokens`` are free'd.

        Frees less if not enough is evictable. Events of the removals are queued.
        """
        check_count(num_tokens, "evict's num_tokens")
        pages, nodes = self.tree.evict(-(-num_tokens // self.page_size))
        return EvictResult(pages * self.page_size, nodes)

    # ---- eviction as the lockstep asks for it (one entry per pool: the full pool) ------
    @property
    def eviction_ask(self) -> tuple[int]:
        """Pages per pool that the last ``admit`` or ``extend`` asked the eviction for
        (``(0,)`` if it evicted nothing). ``evict_pages(eviction_ask)`` on a cache in the
        state that call left after its lock evicts exactly the same nodes."""
        return self._ask

    def evictable_pages(self) -> tuple[int]:
        """Pages per pool that eviction could free now. Pure."""
        return (self.tree.cached_pages - self.tree.protected_pages,)

    def evict_pages(self, asks: tuple[int, ...]) -> tuple[int]:
        """Evict as an ``admit``/``extend`` asking ``asks`` pages per pool does; returns the
        pages freed per pool. For the lockstep (asks already agreed; not validated)."""
        return (self.tree.evict(asks[0])[0],)

    def eviction_marks(self) -> tuple[int]:
        """Pages evicted so far, per pool (a counter that only grows, reset included)."""
        return (self.tree.evicted_pages,)

    def _node(self, handle: Handle) -> Node:
        if type(handle) is not Handle or type(handle.node_id) is not int:
            raise UnknownHandle(f"not a handle of this cache: {handle!r}")
        if handle.owner != self._owner:
            raise UnknownHandle(
                f"handle {handle.node_id} was given out by another cache, or before a reset"
            )
        node = self.tree.nodes.get(handle.node_id)
        if node is None:
            raise UnknownHandle(
                f"handle {handle.node_id} names no cached node (evicted or foreign)"
            )
        return node

    # ---- request lifecycle ------------------------------------------------------------------
    def admit(
        self,
        rid: RequestId,
        tokens: TokenLike,
        priority: int = 0,
        *,
        evict: bool | Evictor = True,
        reserve: int = 0,
    ) -> AdmitResult:
        """Start request ``rid``: match its prompt (reusing at most ``len - 1`` tokens),
        lock the match, evict the shortfall (if ``evict``) and allocate the rest.

        ``reserve``: slots for that many tokens past the prompt are allocated with it (an
        engine that admits a request with room for its first output tokens, or a replay
        that knows the output length), as ``extend(rid, reserve)`` would right after,
        in one allocation. The result's ``num_tokens`` counts them.

        ``evict`` may instead be an ``Evictor``: it is called once, after the lock and
        before the allocation, with the local shortfall in pages, and evicts what it
        decides (a TP rank evicts what the op log says, agreed across ranks). Then
        ``OutOfCapacity`` can come after the match; the lock is released again.

        Raises before changing anything: ``DuplicateRequest``, ``InvalidTokens``
        (empty, malformed, longer than the request limit with the reserve),
        ``OutOfCapacity``, ``CacheError`` (a bad id, priority or reserve).
        """
        rid = self.reqs.check_new(rid)
        key = as_tokens(tokens, copy=True, defer_sign=True)  # the row keeps it (if mutable)
        prio = as_priority(priority)
        total = admitted_length(key.size, reserve, self._limit)
        self._ask = (0,)
        ps = self.page_size
        n = (key.size - 1) // ps * ps
        path, pos, partial, common = self.tree.descend(key, n)
        check_sign(key, pos + common)
        need = -(-total // ps) - (pos + common) // ps
        if need > self.alloc.num_free:
            self._check_room(need, path, partial, common, evict)
        tree = self.tree
        path, pos = tree.take_match(path, pos, partial, common, queue=False)
        node = path[-1] if path else tree.root
        tree.lock(node)
        try:
            pages = self._take_pages(need, evict)
        except OutOfCapacity:
            tree.unlock(node)
            raise
        parts = [p.pages for p in path]
        parts.append(pages)
        row = join_pages(parts)
        self.reqs.add(rid, key, row, total, pos // ps, node, prio)
        return AdmitResult(pos, row, total, ps)

    def extend(self, rid: RequestId, n: int, *, evict: bool | Evictor = True) -> np.ndarray:
        """``n`` more slots for ``rid`` (decode or a prefill chunk); returns their ids."""
        req = self.reqs.get(rid)
        end = extended_length(req, n, self._limit)
        self._ask = (0,)
        ps = self.page_size
        need = -(-end // ps) - req.pages.size
        if need > self.alloc.num_free:
            self._check_room(need, [], None, 0, evict)
        if need or callable(evict):
            req.pages = join_pages((req.pages, self._take_pages(need, evict)))
        start, req.num_tokens = req.num_tokens, end
        return row_slots(req, start, end, ps)

    def cache_unfinished(self, rid: RequestId, tokens: TokenLike) -> int:
        """Cache the whole pages of a running request's tokens so far (chunked prefill).

        ``tokens`` must extend what the cache was given for ``rid`` and have KV (at most
        the slots it holds). Duplicates are freed, the request's row is rewritten to the
        tree's pages and its lock moves to the new last node. Returns the cached length.
        """
        req = self.reqs.get(rid)
        key = as_tokens(tokens, copy=True)  # the row keeps it
        check_extends(rid, req.tokens, key, req.num_tokens)
        n = key.size // self.page_size * self.page_size
        _, tree_pages, node = self.tree.insert(
            key[:n], req.pages[: n // self.page_size], req.priority
        )
        req.pages[: tree_pages.size] = tree_pages
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node
        req.cached_pages = tree_pages.size
        req.tokens = key
        return n

    def finish(self, rid: RequestId, output_tokens: TokenLike = ()) -> int:
        """End ``rid``: cache the whole pages of its tokens plus ``output_tokens`` that have
        KV, free duplicates and the partial tail, unlock. Returns the cached length."""
        req = self.reqs.get(rid)
        out = as_tokens(output_tokens, allow_empty=True)
        ps = self.page_size
        tail, pages, n = finished_tail(req, out, ps)
        self.tree.insert(tail, pages, req.priority, start=req.node, trusted=True, want_pages=False)
        self.alloc.free(req.pages[n // ps :], HELD, checked=False)
        self.tree.unlock(req.node)
        self.reqs.remove(req.rid)
        return n

    def abort(self, rid: RequestId) -> None:
        """End ``rid`` without caching anything: free its own pages and unlock."""
        req = self.reqs.get(rid)
        self.alloc.free(req.pages[req.cached_pages :], HELD, checked=False)
        self.tree.unlock(req.node)
        self.reqs.remove(req.rid)

    def pages_short(self, num_pages: int) -> int:
        """How many more pages than are free ``num_pages`` would need (0 if they fit)."""
        return max(0, num_pages - self.alloc.num_free)

    def _check_room(
        self,
        need: int,
        path: list[Node],
        partial: Node | None,
        common: int,
        evict: bool | Evictor,
    ) -> None:
        free = self.alloc.num_free
        if need <= free or callable(evict):
            return
        if not evict:
            raise OutOfCapacity(f"need {need} pages, {free} free (eviction not allowed here)")
        # Pages on the path about to be locked stop being evictable.
        pinned = sum(p.pages.size for p in path if p.lock == 0)
        if partial is not None and partial.lock == 0:
            pinned += common // self.page_size
        evictable = self.tree.cached_pages - self.tree.protected_pages - pinned
        if need > free + evictable:
            raise OutOfCapacity(
                f"need {need} pages of {self.page_size}: {free} free + {evictable} evictable"
            )

    def _take_pages(self, need: int, evict: bool | Evictor) -> np.ndarray:
        short = self.pages_short(need)
        if callable(evict):
            evict(short)  # called even when nothing is short: it may enter a collective
        elif short and evict:
            self._ask = (short,)
            self.tree.evict(short)
        return self.alloc.alloc(need, HELD, copy=False)  # callers copy it into the row

    # ---- whole-cache --------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cached prefix and running request; announce ``AllBlocksCleared``."""
        events = self.tree.events
        self.alloc.reset()
        self.tree._clear()
        self.reqs = ReqTable()
        self._handle_locks = {}
        self._ask = (0,)
        self._owner = new_owner()
        if self.config.record_events:
            events.append(AllBlocksCleared())
        self.tree.events = events

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in order (empty unless ``record_events``)."""
        events, self.tree.events = self.tree.events, []
        return events

    def sizes(self) -> CacheSizes:
        ps = self.page_size
        t = self.tree
        return CacheSizes(
            capacity=self.alloc.num_pages * ps,
            free=self.alloc.num_free * ps,
            evictable=(t.cached_pages - t.protected_pages) * ps,
            protected=t.protected_pages * ps,
            held=(self.alloc.count(HELD) + self.alloc.count(LENT)) * ps,
        )

    def request_row(self, rid: RequestId) -> RequestRow:
        """Running request ``rid`` (read-only views). Raises ``UnknownRequest``, or
        ``CacheError`` for a malformed id."""
        return self.reqs.row(rid, self.page_size)

    def running_ids(self) -> list[RequestId]:
        """The running requests' ids, in admission order."""
        return self.reqs.ids()

    def pool_sizes(self) -> tuple[CacheSizes, ...]:
        """``sizes()`` per pool (here one: the full pool), for callers that treat every
        cache kind alike."""
        return (self.sizes(),)

    def digest(self) -> int:
        """64-bit digest of the cached contents and their slots, page ownership, locks,
        running requests, the node count, and the clocks that order what comes next (the
        policy tick, the free FIFO's position). Caches that applied the same ops share it,
        and a reset cache shares a fresh one's (node ids, which keep growing across a
        reset, are left out); any difference changes it (whp). Costs O(1)."""
        t = self.tree
        t.ensure_hashed()
        return fold_fields(
            fmix64_int(t.digest_sum ^ 0x5A17),
            (*self.alloc.fingerprint(), t.tick, len(t.nodes), t.protected_pages, len(self.reqs)),
        )

    def check_integrity(self) -> None:
        """Verify the conservation law, the tree, the allocator and every request row.

        Raises ``IntegrityError`` with the numbers. Costs a full walk: for tests and idle.
        """
        s = self.sizes()
        total = s.free + s.evictable + s.protected + s.held
        if total != s.capacity:
            raise IntegrityError(
                f"free {s.free} + evictable {s.evictable} + protected {s.protected} + held {s.held}"
                f" = {total} != capacity {s.capacity}"
            )
        counts = tuple(self.alloc.count(t) for t in (FREE, HELD, CACHED, LENT))
        if sum(counts) != self.alloc.num_pages:
            raise IntegrityError(
                f"allocator counts {counts} do not add up to {self.alloc.num_pages}"
            )
        self.alloc.check_integrity()
        self.tree.check_integrity()
        self.reqs.check_integrity(self.tree, self.alloc)
        rows = self.reqs.held_pages()
        if rows != self.alloc.count(HELD):
            raise IntegrityError(
                f"request rows hold {rows} pages, but {self.alloc.count(HELD)} pages are tagged held"
            )
        self._check_locks()

    def _check_locks(self) -> None:
        # Every node's lock count is exactly the requests and handle locks at or below it.
        holders = [(self.reqs.get(rid).node, 1) for rid in self.reqs.ids()]
        for node_id, count in self._handle_locks.items():
            node = self.tree.nodes.get(node_id)
            if node is None:
                raise IntegrityError(f"handle {node_id} holds {count} locks on a node that is gone")
            holders.append((node, count))
        expected: dict[int, int] = {}
        root = self.tree.root
        for node, count in holders:
            while node is not root:
                expected[node.id] = expected.get(node.id, 0) + count
                node = node.parent  # type: ignore[assignment]
        for node in self.tree.walk():
            if node.lock != expected.get(node.id, 0):
                raise IntegrityError(
                    f"node {node.id} has lock {node.lock}, but requests and handles hold"
                    f" {expected.get(node.id, 0)} locks on it"
                )


__all__ = [
    "AdmitResult",
    "CacheConfig",
    "CacheSizes",
    "EvictResult",
    "Handle",
    "MatchResult",
    "RadixCache",
]
