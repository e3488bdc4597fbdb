"""``HybridCache``: the cache state machine for models mixing full and sliding-window layers.

It offers the operations and result records of ``RadixCache`` (match, insert, lock and
unlock of a handle, evict, admit/extend/cache_unfinished/finish/abort, reset, sizes,
digest, events, ``check_integrity``), so workers drive either through the same calls.
What differs: two pools (full and SWA) joined by a paired allocator; tombstones (full KV
without SWA KV); window-aware matching; two-level locks; ``evict(full, swa)``.

Decisions:
- A running request holds full *and* SWA slots for all its own tokens until it ends
  (no freeing of SWA KV that slid out of its window while it runs), so a request may
  not exceed the SWA pool and every HELD page has an SWA page.
- Insert over a tombstone revives it by moving the newcomer's SWA pages onto the
  tombstone's full pages; the newcomer's full pages are freed as duplicates. Full pages,
  block hashes and events stay as they are (a block is stored once and removed once,
  when its full KV goes), and requests that hold the tombstone's full pages are safe.
- The SWA lock boundary is a mark on the top node of the lock's window, kept in the
  handle (``SwaHandle.swa_boundary``) and, for requests, in the cache; a split moves it
  to the upper half. An unlock whose mark is not on the handle's path raises
  ``StaleBoundary`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpcache.cache.allocator import HELD, LENT
from tpcache.cache.errors import (
    AllocatorError,
    CacheError,
    IntegrityError,
    InvalidSlots,
    InvalidTokens,
    LockError,
    OutOfCapacity,
    UnknownHandle,
)
from tpcache.cache.events import AllBlocksCleared, KVEvent
from tpcache.cache.hashing import fmix64_int
from tpcache.cache.keys import TokenLike, as_slots, as_tokens, pages_to_slots, slots_to_pages
from tpcache.cache.policies import policy_key
from tpcache.cache.radix import CacheSizes
from tpcache.cache.reqtable import Req, ReqTable, RequestId
from tpcache.cache.swa_allocator import PairedAllocator
from tpcache.cache.swa_check import check_tree
from tpcache.cache.swa_config import (
    HybridConfig,
    HybridSizes,
    SwaAdmitResult,
    SwaEvictResult,
    SwaHandle,
    SwaMatchResult,
)
from tpcache.cache.swa_tree import SwaNode, SwaTree

_MASK = (1 << 64) - 1
_EMPTY = np.zeros(0, dtype=np.int64)

# Called with the local shortfalls in pages (full, SWA); evicts what it decides.
HybridEvictor = Callable[[int, int], object]


class HybridCache:
    """A paged radix prefix cache over a full and an SWA pool, with its request table."""

    def __init__(self, config: HybridConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.window = config.sliding_window
        self.alloc = PairedAllocator(config.num_pages, config.num_swa_pages, config.page_size)
        self.tree = SwaTree(
            self.alloc,
            policy_key(config.policy),
            config.sliding_window,
            record_events=config.record_events,
            medium=config.medium,
        )
        self.reqs = ReqTable()
        self._tops: dict[RequestId, int] = {}  # request -> boundary mark of its SWA lock
        # lock() calls not yet undone, per handle (node id, boundary mark). Owned here: a
        # handle's unlock must never take a lock that a running request holds.
        self._handle_locks: dict[tuple[int, int], int] = {}

    # ---- tree-level operations ------------------------------------------------------------
    def match_prefix(self, tokens: TokenLike) -> SwaMatchResult:
        """The longest window-valid cached prefix of ``tokens`` in whole pages.

        May split a node, advances the access clock and may give a node a boundary mark;
        never changes slot ownership.
        """
        key = as_tokens(tokens)
        tree = self.tree
        path, pos = tree.take_match(
            *tree.match_walk(key, key.size // self.page_size * self.page_size)
        )
        tree.touch(path)
        node = path[-1] if path else tree.root
        handle = SwaHandle(node.id, tree.mark_of(tree.boundary(node)))
        pages = np.concatenate([p.pages for p in path]) if path else _EMPTY
        swa = self.alloc.swa_of(pages[max(0, pos - self.window) // self.page_size :])
        return SwaMatchResult(pos, pages, handle, self.page_size, swa)

    def insert(self, tokens: TokenLike, slots: TokenLike, priority: int = 0) -> int:
        """Cache the whole pages of ``tokens`` held at ``slots``; returns tokens already cached.

        As ``RadixCache.insert`` (``slots`` lent by ``alloc_slots``, or the tree's own for
        the cached part); tombstones on the way whose pages are given anew are revived.
        Raises ``InvalidSlots`` (changing nothing) for malformed slots, slots not lent to
        the caller, or when the new part could never be matched after a tombstone.
        """
        key = as_tokens(tokens)
        slot_ids = as_slots(slots, key.size, self._slot_limit)
        n = key.size // self.page_size * self.page_size
        pages = slots_to_pages(slot_ids[:n], self.page_size)
        have, _, _ = self.tree.insert(key[:n], pages, _as_priority(priority), owner=LENT)
        return have

    @property
    def _slot_limit(self) -> int:
        return self.alloc.full.num_pages * self.page_size

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages (full and SWA) for ``num_tokens`` tokens, lent to the caller
        (no eviction); returns the full slot ids (``swa_slots`` maps them). The caller
        gives them back with ``insert`` or ``free_slots``. Raises ``OutOfCapacity``
        (nothing taken) if either pool has too few free pages."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise CacheError(f"alloc_slots needs an int >= 0, got {num_tokens!r}")
        pages = self.alloc.alloc(-(-num_tokens // self.page_size), LENT)
        return pages_to_slots(pages, self.page_size, num_tokens)

    def free_slots(self, slots: TokenLike) -> None:
        """Free pages lent by ``alloc_slots`` (full and SWA), given by all their slots.

        Raises ``InvalidSlots`` or ``AllocatorError`` (nothing freed) for malformed slots
        or pages not lent to a caller.
        """
        slot_ids = as_slots(slots, None, self._slot_limit)
        pages = slots_to_pages(slot_ids, self.page_size)
        self.alloc.free(pages, LENT)

    def swa_slots(self, slots: TokenLike) -> np.ndarray:
        """The SWA slot ids of full slot ids (same offset in the paired page). Pure.

        Raises ``InvalidSlots`` for ids out of range or on a page without SWA KV.
        """
        slot_ids = as_slots(slots, None, self._slot_limit)
        ps = self.page_size
        pages = slot_ids // ps
        try:
            swa = self.alloc.swa_of(pages)
        except AllocatorError as exc:
            raise InvalidSlots(str(exc)) from None
        return swa.astype(np.int64) * ps + slot_ids % ps

    def lock(self, handle: SwaHandle) -> None:
        """Protect the matched prefix of ``handle``: full KV up to the root, SWA KV of its
        last window. Locks nest. Raises ``UnknownHandle``, ``StaleBoundary``, or
        ``LockError`` if the window lost SWA KV since the match; nothing changes then."""
        node = self._node(handle)
        top = self.tree.find_top(node, handle.swa_boundary)
        self.tree.check_lockable(node, top)
        self.tree.lock(node, top)
        key = (node.id, handle.swa_boundary)
        self._handle_locks[key] = self._handle_locks.get(key, 0) + 1

    def unlock(self, handle: SwaHandle) -> None:
        """Undo one ``lock`` of ``handle``. Raises ``UnknownHandle``, ``StaleBoundary`` (its
        boundary is not on its path) or ``LockError`` (this handle holds no lock; a
        running request's lock does not count); nothing changes then."""
        node = self._node(handle)
        top = self.tree.find_top(node, handle.swa_boundary)
        key = (node.id, handle.swa_boundary)
        held = self._handle_locks.get(key, 0)
        if held == 0:
            raise LockError(f"handle {key} is not locked (by lock())")
        self.tree.unlock(node, top)
        if held == 1:
            del self._handle_locks[key]
        else:
            self._handle_locks[key] = held - 1

    def evict(self, full_tokens: int, swa_tokens: int = 0) -> SwaEvictResult:
        """Evict from the full order (unlocked leaves) until ``full_tokens`` full KV tokens
        are freed, then from the SWA order (tombstoning internal nodes, deleting leaves)
        until ``swa_tokens`` SWA KV tokens are freed. Frees less if not enough is
        evictable. Removal events are queued."""
        for name, value in (("full_tokens", full_tokens), ("swa_tokens", swa_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CacheError(f"evict needs {name} as an int >= 0, got {value!r}")
        ps = self.page_size
        full, swa, nodes, tombs = self.tree.evict(-(-full_tokens // ps), -(-swa_tokens // ps))
        return SwaEvictResult(full * ps, nodes, swa * ps, tombs)

    def _node(self, handle: SwaHandle) -> SwaNode:
        if not isinstance(handle, SwaHandle):
            raise UnknownHandle(f"not a handle of a hybrid cache: {handle!r}")
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
        evict: bool | HybridEvictor = True,
    ) -> SwaAdmitResult:
        """Start request ``rid``: match its prompt (window-valid, at most ``len - 1``
        tokens), lock the match, evict the shortfall of either pool (if ``evict``) and
        allocate the rest (full and SWA pages).

        ``evict`` may be a ``HybridEvictor``, called once after the lock with the local
        (full, SWA) shortfalls in pages; then ``OutOfCapacity`` can come after the match
        and the lock is released again. Otherwise raises before changing anything:
        ``DuplicateRequest``, ``InvalidTokens``, ``OutOfCapacity``.
        """
        self.reqs.check_new(rid)
        key = as_tokens(tokens, copy=True)  # the row keeps it
        prio = _as_priority(priority)
        limit = self.config.request_limit
        if key.size > limit:
            raise InvalidTokens(f"prompt of {key.size} tokens exceeds the limit {limit}")
        ps = self.page_size
        tree = self.tree
        path, pos, partial, common = tree.match_walk(key, (key.size - 1) // ps * ps)
        need = -(-key.size // ps) - (pos + common) // ps
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
        row = np.concatenate([*(p.pages for p in path), pages])
        k, first = pos // ps, max(0, pos - self.window) // ps
        swa = (
            np.concatenate((self.alloc.swa_of(row[first:k]), own_swa))
            if k > first
            else own_swa.copy()
        )
        self.reqs.add(rid, key, row, key.size, k, node, prio)
        self._tops[rid] = tree.mark_of(top)
        return SwaAdmitResult(pos, row, key.size, ps, swa)

    def extend(self, rid: RequestId, n: int, *, evict: bool | HybridEvictor = True) -> np.ndarray:
        """``n`` more slots for ``rid`` (decode or a prefill chunk); returns their full ids."""
        req = self.reqs.get(rid)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheError(f"extend needs an int >= 0, got {n!r}")
        limit = self.config.request_limit
        if req.num_tokens + n > limit:
            raise InvalidTokens(
                f"request {rid!r} would hold {req.num_tokens + n} tokens, limit {limit}"
            )
        ps = self.page_size
        need = -(-(req.num_tokens + n) // ps) - req.pages.size
        self._check_room(need, [], None, 0, evict)
        if need or callable(evict):
            req.pages = np.concatenate((req.pages, self._take_pages(need, evict)[0]))
        start = req.num_tokens
        req.num_tokens += n
        first = start // ps
        return pages_to_slots(req.pages[first:], ps)[start - first * ps : start - first * ps + n]

    def cache_unfinished(self, rid: RequestId, tokens: TokenLike) -> int:
        """Cache the whole pages of a running request's tokens so far (chunked prefill).

        As ``RadixCache.cache_unfinished``; the request's locks (full and SWA, with a
        new boundary) move to the new last node. Returns the cached length.
        """
        req = self.reqs.get(rid)
        key = as_tokens(tokens, copy=True)  # the row keeps it
        _check_extends(rid, req.tokens, key, req.num_tokens)
        n = key.size // self.page_size * self.page_size
        _, tree_pages, node = self._insert_own(req, key[:n])
        req.pages[: tree_pages.size] = tree_pages
        tree = self.tree
        top = tree.boundary(node)
        tree.lock(node, top)
        tree.unlock(req.node, tree.find_top(req.node, self._tops[rid]))
        req.node = node
        req.cached_pages = tree_pages.size
        req.tokens = key
        self._tops[rid] = tree.mark_of(top)
        return n

    def finish(self, rid: RequestId, output_tokens: TokenLike = ()) -> int:
        """End ``rid``: cache the whole pages of its tokens plus ``output_tokens`` that have
        KV, free duplicates and the partial tail, unlock. Returns the cached length."""
        req = self.reqs.get(rid)
        out = as_tokens(output_tokens, allow_empty=True)
        seq = np.concatenate((req.tokens, out)) if out.size else req.tokens
        ps = self.page_size
        n = min(seq.size, req.num_tokens) // ps * ps
        self._insert_own(req, seq[:n], want_pages=False)
        self.alloc.free(req.pages[n // ps :], HELD, checked=False)
        self._end(req)
        return n

    def abort(self, rid: RequestId) -> None:
        """End ``rid`` without caching anything: free its own pages and unlock."""
        req = self.reqs.get(rid)
        self.alloc.free(req.pages[req.cached_pages :], HELD, checked=False)
        self._end(req)

    def _end(self, req: Req) -> None:
        mark = self._tops.pop(req.rid)
        self.tree.unlock(req.node, self.tree.find_top(req.node, mark))
        self.reqs.remove(req.rid)

    def _insert_own(
        self, req: Req, key: np.ndarray, *, want_pages: bool = True
    ) -> tuple[int, np.ndarray | None, SwaNode]:
        # The row's prefix is the locked path to req.node, so the walk starts there.
        return self.tree.insert(
            key,
            req.pages[: key.size // self.page_size],
            req.priority,
            start=req.node,
            start_pos=req.cached_pages * self.page_size,
            trusted=True,
            want_pages=want_pages,
        )

    def pages_short(self, num_pages: int) -> int:
        """How many more pages than are free ``num_pages`` would need in the fuller pool."""
        return max(0, num_pages - self.alloc.num_free)

    def _check_room(
        self,
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
            acc += p.key.size
            swa_pinned += p.pages.size if p.swa_lock == 0 else 0
        full_ev = t.cached_pages - t.protected_pages - pinned
        swa_ev = t.swa_pages - t.swa_protected - swa_pinned
        if need > full_free + full_ev or need > swa_free + swa_ev:
            raise OutOfCapacity(
                f"need {need} pages of {ps}: full {full_free} free + {full_ev} evictable,"
                f" SWA {swa_free} free + {swa_ev} evictable"
            )

    def _take_pages(self, need: int, evict: bool | HybridEvictor) -> tuple[np.ndarray, np.ndarray]:
        """``need`` full pages and their SWA pages: views, valid until the next free."""
        short_full = max(0, need - self.alloc.full.num_free)
        short_swa = max(0, need - self.alloc.swa.num_free)
        if callable(evict):
            evict(short_full, short_swa)  # called even when nothing is short
        elif (short_full or short_swa) and evict:
            self.tree.evict(short_full, short_swa)
        return self.alloc.alloc_pair(need, HELD, copy=False)  # callers copy them at once

    # ---- whole-cache --------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cached prefix and running request; announce ``AllBlocksCleared``."""
        events = self.tree.events
        self.alloc.reset()
        self.tree._clear()
        self.reqs = ReqTable()
        self._tops = {}
        self._handle_locks = {}
        if self.config.record_events:
            events.append(AllBlocksCleared())
        self.tree.events = events

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in order (empty unless ``record_events``)."""
        events, self.tree.events = self.tree.events, []
        return events

    def sizes(self) -> HybridSizes:
        """Token counts per pool (the full pool's inline, the SWA pool's in ``swa``)."""
        ps, t, a = self.page_size, self.tree, self.alloc
        # Every held or lent full page has its SWA page (check_integrity verifies it).
        held = (a.full.count(HELD) + a.full.count(LENT)) * ps
        swa = CacheSizes(
            capacity=a.swa.num_pages * ps,
            free=a.swa.num_free * ps,
            evictable=(t.swa_pages - t.swa_protected) * ps,
            protected=t.swa_protected * ps,
            held=held,
        )
        return HybridSizes(
            capacity=a.full.num_pages * ps,
            free=a.full.num_free * ps,
            evictable=(t.cached_pages - t.protected_pages) * ps,
            protected=t.protected_pages * ps,
            held=held,
            swa=swa,
            tombstones=t.tombstones,
            tombstone_tokens=t.tombstone_pages * ps,
        )

    def digest(self) -> int:
        """64-bit digest as ``RadixCache.digest`` (cached contents and their full pages,
        ownership, locks, requests, node count, the policy tick and FIFO positions), over
        both pools, with the SWA locks and tombstones. SWA pages enter through the SWA
        pool's owner counts and id sums (which node holds which SWA page is left out:
        it would cost a lookup per change). Costs O(1)."""
        t = self.tree
        x = fmix64_int(t.digest_sum ^ 0x5A17)
        for v in (*self.alloc.fingerprint(), t.tick, len(t.nodes)):
            x = fmix64_int(x ^ (v & _MASK))
        x ^= fmix64_int((t.protected_pages << 32) ^ len(self.reqs) ^ 0x1F83D9AB)
        x = fmix64_int(x ^ (t.swa_protected << 32) ^ (t.tombstone_pages << 8) ^ t.tombstones)
        return x & _MASK

    def check_integrity(self) -> None:
        """Verify the conservation law per pool, both pools and the mapping, the tree (see
        ``swa_check.check_tree``) and every request row and lock boundary.

        Raises ``IntegrityError`` with the numbers. Costs a full walk: for tests and idle.
        """
        s = self.sizes()
        for name, p in (("full", s.full), ("SWA", s.swa)):
            total = p.free + p.evictable + p.protected + p.held
            if total != p.capacity:
                raise IntegrityError(
                    f"{name} pool: free {p.free} + evictable {p.evictable} + protected"
                    f" {p.protected} + held {p.held} = {total} != capacity {p.capacity}"
                )
        self.alloc.check_integrity()
        check_tree(self.tree)
        self.reqs.check_integrity(self.tree, self.alloc.full)  # type: ignore[arg-type]
        self._check_rows()
        self._check_locks()

    def _check_rows(self) -> None:
        rows = self.reqs.held_pages()
        a = self.alloc
        if rows != a.full.count(HELD):
            raise IntegrityError(
                f"request rows hold {rows} pages, but {a.full.count(HELD)} pages are tagged held"
            )
        for tag, name in ((HELD, "held"), (LENT, "lent")):
            if a.swa_count(tag) != a.full.count(tag):
                raise IntegrityError(
                    f"{a.full.count(tag)} full pages are {name} but {a.swa_count(tag)} of"
                    " them have SWA pages"
                )
        if list(self._tops) != self.reqs.ids():
            raise IntegrityError("lock boundaries and running requests differ")
        for rid in self.reqs.ids():
            req = self.reqs.get(rid)
            if not a.has_swa(req.pages[req.cached_pages :]).all():
                raise IntegrityError(f"request {rid!r} holds a page without SWA KV")

    def _check_locks(self) -> None:
        # Every node's full and SWA lock counts are exactly those of the requests and
        # handle locks at or below it (SWA: up to each one's boundary).
        holders = [(self.reqs.get(rid).node, self._tops[rid], 1) for rid in self.reqs.ids()]
        for (node_id, mark), count in self._handle_locks.items():
            node = self.tree.nodes.get(node_id)
            if node is None:
                raise IntegrityError(f"handle {node_id} holds {count} locks on a node that is gone")
            holders.append((node, mark, count))
        full: dict[int, int] = {}
        swa: dict[int, int] = {}
        root = self.tree.root
        for node, mark, count in holders:
            try:
                top = self.tree.find_top(node, mark)
            except CacheError as exc:
                raise IntegrityError(f"a lock on node {node.id}: {exc}") from None
            in_window = True
            while node is not root:
                full[node.id] = full.get(node.id, 0) + count
                if in_window:
                    swa[node.id] = swa.get(node.id, 0) + count
                    in_window = node is not top
                node = node.parent  # type: ignore[assignment]
        for node in self.tree.walk():
            want = (full.get(node.id, 0), swa.get(node.id, 0))
            if (node.lock, node.swa_lock) != want:
                raise IntegrityError(
                    f"node {node.id} has locks (full, SWA) {(node.lock, node.swa_lock)}, but"
                    f" requests and handles hold {want}"
                )


def _check_extends(rid: RequestId, known: np.ndarray, key: np.ndarray, limit: int) -> None:
    if key.size < known.size or not np.array_equal(key[: known.size], known):
        raise InvalidTokens(f"tokens for {rid!r} do not extend the {known.size} tokens it has")
    if key.size > limit:
        raise InvalidTokens(f"{key.size} tokens for {rid!r}, but it holds KV for only {limit}")


def _as_priority(priority: object) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise CacheError(f"priority must be an int, got {priority!r}")
    return priority


__all__ = ["HybridCache", "HybridEvictor"]
