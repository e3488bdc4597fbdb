"""The request lifecycle of ``HybridCache`` (a mixin): admit, extend, cache_unfinished,
finish, abort, with the room checks and the eviction of the shortfall in both pools.

A running request holds full *and* SWA slots for all its own tokens until it ends (no
freeing of SWA KV that slid out of its window while it runs), so a request may not be
longer than the SWA pool, and every page a request holds has an SWA page. Its locks are
two-level (``swa_locks.py``); the cache keeps the boundary mark of each request's SWA
lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import HELD
from tpcache.cache.errors import OutOfCapacity
from tpcache.cache.keys import TokenLike, as_tokens, check_sign, join_pages
from tpcache.cache.reqtable import (
    Req,
    RequestId,
    admitted_length,
    as_priority,
    check_extends,
    extended_length,
    finished_tail,
    row_slots,
)
from tpcache.cache.swa_config import SwaAdmitResult

if TYPE_CHECKING:
    from tpcache.cache.swa_cache import HybridCache
    from tpcache.cache.swa_node import SwaNode

# Called with the local shortfalls in pages (full, SWA); evicts what it decides.
HybridEvictor = Callable[[int, int], object]


class RequestLifecycle:
    """Request part of ``HybridCache`` (a mixin: it uses the cache's fields)."""

    def admit(
        self: HybridCache,
        rid: RequestId,
        tokens: TokenLike,
        priority: int = 0,
        *,
        evict: bool | HybridEvictor = True,
        reserve: int = 0,
    ) -> SwaAdmitResult:
        """Start request ``rid``: match its prompt (window-valid, at most ``len - 1``
        tokens), lock the match, evict the shortfall of either pool (if ``evict``) and
        allocate the rest (full and SWA pages), with ``reserve`` more slots past the
        prompt as in ``RadixCache.admit``.

        ``evict`` may be a ``HybridEvictor``, called once after the lock with the local
        (full, SWA) shortfalls in pages; then ``OutOfCapacity`` can come after the match
        and the lock is released again. Otherwise raises before changing anything:
        ``DuplicateRequest``, ``InvalidTokens``, ``OutOfCapacity``, ``CacheError``.
        """
        rid = self.reqs.check_new(rid)
        key = as_tokens(tokens, copy=True, defer_sign=True)  # the row keeps it (if mutable)
        prio = as_priority(priority)
        total = admitted_length(key.size, reserve, self._limit)
        self._ask = (0, 0)
        ps = self.page_size
        tree = self.tree
        path, pos, partial, common = tree.match_walk(key, (key.size - 1) // ps * ps)
        check_sign(key, pos + common)
        need = -(-total // ps) - (pos + common) // ps
        self._check_room(need, path, partial, common, evict)
        path, pos = tree.take_match(path, pos, partial, common)
        node = path[-1] if path else tree.root
        top = tree.boundary(node)
        tree.lock(node, top)
        tree.touch(path)
        try:
            pages, own_swa = self._take_pages(need, evict)
        except OutOfCapacity:
            tree.unlock(node, top)
            raise
        row = join_pages([*(p.pages for p in path), pages])
        k, first = pos // ps, max(0, pos - self.window) // ps
        # The matched window has SWA KV (the match is window-valid), so no check here.
        swa = (
            np.concatenate((self.alloc.swa_of(row[first:k], checked=False), own_swa))
            if k > first
            else own_swa.copy()
        )
        self.reqs.add(rid, key, row, total, k, node, prio)
        self._tops[rid] = tree.mark_of(top)
        return SwaAdmitResult(pos, row, total, ps, swa)

    def extend(
        self: HybridCache, rid: RequestId, n: int, *, evict: bool | HybridEvictor = True
    ) -> np.ndarray:
        """``n`` more slots for ``rid`` (decode or a prefill chunk); returns their full ids."""
        req = self.reqs.get(rid)
        end = extended_length(req, n, self._limit)
        self._ask = (0, 0)
        ps = self.page_size
        need = -(-end // ps) - req.pages.size
        if need > self.alloc.num_free:
            self._check_room(need, [], None, 0, evict)
        if need or callable(evict):
            req.pages = join_pages((req.pages, self._take_pages(need, evict)[0]))
        start, req.num_tokens = req.num_tokens, end
        return row_slots(req, start, end, ps)

    def cache_unfinished(self: HybridCache, rid: RequestId, tokens: TokenLike) -> int:
        """Cache the whole pages of a running request's tokens so far (chunked prefill).

        As ``RadixCache.cache_unfinished``; the request's locks (full and SWA, with a
        new boundary) move to the new last node. Returns the cached length.
        """
        req = self.reqs.get(rid)
        key = as_tokens(tokens, copy=True)  # the row keeps it
        check_extends(rid, req.tokens, key, req.num_tokens)
        n = key.size // self.page_size * self.page_size
        _, tree_pages, node = self._insert_own(req, key[:n])
        req.pages[: tree_pages.size] = tree_pages
        tree = self.tree
        top = tree.boundary(node)
        tree.lock(node, top)
        tree.unlock(req.node, tree.find_top(req.node, self._tops[req.rid]))
        req.node = node
        req.cached_pages = tree_pages.size
        req.tokens = key
        self._tops[req.rid] = tree.mark_of(top)
        return n

    def finish(self: HybridCache, rid: RequestId, output_tokens: TokenLike = ()) -> int:
        """End ``rid``: cache the whole pages of its tokens plus ``output_tokens`` that have
        KV, free duplicates and the partial tail, unlock. Returns the cached length."""
        req = self.reqs.get(rid)
        out = as_tokens(output_tokens, allow_empty=True)
        ps = self.page_size
        tail, pages, n = finished_tail(req, out, ps)
        self.tree.insert(tail, pages, req.priority, start=req.node, trusted=True, want_pages=False)
        self.alloc.free(req.pages[n // ps :], HELD, checked=False)
        self._end(req)
        return n

    def abort(self: HybridCache, rid: RequestId) -> None:
        """End ``rid`` without caching anything: free its own pages and unlock."""
        req = self.reqs.get(rid)
        self.alloc.free(req.pages[req.cached_pages :], HELD, checked=False)
        self._end(req)

    def _end(self: HybridCache, req: Req) -> None:
        mark = self._tops.pop(req.rid)
        self.tree.unlock(req.node, self.tree.find_top(req.node, mark))
        self.reqs.remove(req.rid)

    def _insert_own(
        self: HybridCache, req: Req, key: np.ndarray
    ) -> tuple[int, np.ndarray | None, SwaNode]:
        # The row's prefix is the locked path to req.node, so the walk starts there.
        return self.tree.insert(
            key,
            req.pages[: key.size // self.page_size],
            req.priority,
            start=req.node,
            start_pos=req.cached_pages * self.page_size,
            trusted=True,
        )

    def pages_short(self: HybridCache, num_pages: int) -> int:
        """How many more pages than are free ``num_pages`` would need in the fuller pool."""
        return max(0, num_pages - self.alloc.num_free)

    def _check_room(
        self: HybridCache,
        need: int,
        path: list[SwaNode],
        partial: SwaNode | None,
        common: int,
        evict: bool | HybridEvictor,
    ) -> None:
        full_free, swa_free = self.alloc.full.num_free, self.alloc.swa.num_free
        if (need <= full_free and need <= swa_free) or callable(evict):
            return
        if not evict:
            raise OutOfCapacity(
                f"need {need} pages, {full_free} full and {swa_free} SWA free"
                " (eviction not allowed here)"
            )
        t, ps = self.tree, self.page_size
        # Pages about to be locked stop being evictable: the whole path (full) and its
        # last window (SWA); a partial node's matched part becomes the end node.
        pinned = sum(p.pages.size for p in path if p.lock == 0)
        swa_pinned = 0
        acc = 0
        if partial is not None:
            pinned += common // ps if partial.lock == 0 else 0
            swa_pinned += common // ps if partial.swa_lock == 0 else 0
            acc = common
        for p in reversed(path):
            if acc >= self.window:
                break
            acc += p.ntok
            swa_pinned += p.pages.size if p.swa_lock == 0 else 0
        full_ev = t.cached_pages - t.protected_pages - pinned
        swa_ev = t.swa_pages - t.swa_protected - swa_pinned
        if need > full_free + full_ev or need > swa_free + swa_ev:
            raise OutOfCapacity(
                f"need {need} pages of {ps}: full {full_free} free + {full_ev} evictable,"
                f" SWA {swa_free} free + {swa_ev} evictable"
            )

    def _take_pages(
        self: HybridCache, need: int, evict: bool | HybridEvictor
    ) -> tuple[np.ndarray, np.ndarray]:
        """``need`` full pages and their SWA pages: views, valid until the next free."""
        short_full = max(0, need - self.alloc.full.num_free)
        short_swa = max(0, need - self.alloc.swa.num_free)
        if callable(evict):
            evict(short_full, short_swa)  # called even when nothing is short
        elif (short_full or short_swa) and evict:
            self._ask = (short_full, short_swa)
            self.tree.evict(short_full, short_swa)
        return self.alloc.alloc_pair(need, HELD, copy=False)  # callers copy them at once
