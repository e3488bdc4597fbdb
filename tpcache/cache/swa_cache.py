"""``HybridCache``: the cache state machine for models mixing full and sliding-window layers.

It offers the operations and result records of ``RadixCache`` (match, insert, lock and
unlock of a handle, evict, admit/extend/cache_unfinished/finish/abort, reset, sizes,
digest, events, ``check_integrity``), so workers drive either through the same calls.
What differs: two pools (full and SWA) joined by a paired allocator; tombstones (full KV
without SWA KV); window-aware matching; two-level locks; ``evict(full, swa)``; results
that also carry SWA pages.

Decisions:
- A running request holds full and SWA slots for all its own tokens until it ends (see
  ``swa_requests.py``): no request-side freeing of SWA KV that slid out of its window.
- Insert over a tombstone revives it by moving the newcomer's SWA pages onto the
  tombstone's full pages; the newcomer's full pages are freed as duplicates. Full pages,
  block hashes and events stay as they are (a block is stored once and removed once,
  when its full KV goes; losing SWA KV is no event), and requests that hold the
  tombstone's full pages are safe.
- Every leaf stays a valid match end: a leaf that a tombstone left less than a window
  behind is deleted (it could never be matched), cascading upward (``swa_evict.py``).
- The SWA lock boundary is a mark on the top node of the lock's window, kept in the
  handle (``SwaHandle.swa_boundary``) and, for requests, in the cache; a split moves it
  to the upper half. An unlock whose mark is not on the handle's path raises
  ``StaleBoundary`` and changes nothing.

Files: ``swa_config`` (config and records), ``swa_allocator`` (the two pools),
``swa_node``/``swa_tree``/``swa_locks``/``swa_evict`` (the tree), ``swa_requests`` (the
request lifecycle), ``swa_check`` (the full walks of ``check_integrity``).
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import HELD, LENT
from tpcache.cache.errors import (
    AllocatorError,
    IntegrityError,
    InvalidSlots,
    LockError,
    UnknownHandle,
)
from tpcache.cache.events import AllBlocksCleared, KVEvent
from tpcache.cache.hashing import fmix64_int, fold_fields
from tpcache.cache.keys import (
    TokenLike,
    as_slots,
    as_tokens,
    join_pages,
    pages_to_slots,
    slots_to_pages,
)
from tpcache.cache.node import hash_pending
from tpcache.cache.policies import policy_key
from tpcache.cache.records import CacheSizes, RequestRow, new_owner
from tpcache.cache.reqtable import ReqTable, RequestId, as_priority, check_count
from tpcache.cache.swa_allocator import PairedAllocator
from tpcache.cache.swa_check import check_locks, check_requests, check_tree
from tpcache.cache.swa_config import (
    HybridConfig,
    HybridSizes,
    SwaEvictResult,
    SwaHandle,
    SwaMatchResult,
)
from tpcache.cache.swa_evict import swa_policy_key
from tpcache.cache.swa_node import StaleBoundary, SwaNode
from tpcache.cache.swa_requests import HybridEvictor, RequestLifecycle
from tpcache.cache.swa_tree import SwaTree

_EMPTY = np.zeros(0, dtype=np.int64)


class HybridCache(RequestLifecycle):
    """A paged radix prefix cache over a full and an SWA pool, with its request table.

    The tree (``tree``), the paired allocator (``alloc``) and the request table
    (``reqs``) are owned here and changed only through these methods; so are the lock
    records (``_tops``: each request's SWA boundary mark; ``_handle_locks``: the
    ``lock()`` calls of each handle not yet undone), which ``check_integrity`` uses to
    recount every node's full and SWA lock. Logical clock, per-cache ids and marks and
    the two FIFOs make every decision the same in every process.
    """

    def __init__(self, config: HybridConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.window = config.sliding_window
        self.alloc = PairedAllocator(config.num_pages, config.num_swa_pages, config.page_size)
        self.tree = SwaTree(
            self.alloc,
            policy_key(config.policy),
            config.sliding_window,
            swa_key_fn=swa_policy_key(config.policy),
            record_events=config.record_events,
            medium=config.medium,
        )
        self.reqs = ReqTable()
        self._limit = config.request_limit  # read on every admit and extend
        self._tops: dict[RequestId, int] = {}  # request -> boundary mark of its SWA lock
        # lock() calls not yet undone, per handle (node id, boundary mark). Owned here: a
        # handle's unlock must never take a lock that a running request holds.
        self._handle_locks: dict[tuple[int, int], int] = {}
        # (full, SWA) pages the last admit or extend asked the eviction for: the decision
        # a TP rank repeats (``eviction_ask``). Set in ``RequestLifecycle``.
        self._ask: tuple[int, int] = (0, 0)
        self._owner = new_owner()  # stamped on the handles this generation gives out

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
        handle = SwaHandle(node.id, self._owner, tree.mark_of(tree.boundary(node)))
        pages = join_pages([p.pages for p in path]) if path else _EMPTY
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
        have, _, _ = self.tree.insert(key[:n], pages, as_priority(priority), owner=LENT)
        return have

    @property
    def _slot_limit(self) -> int:
        return self.alloc.full.num_pages * self.page_size

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages (full and SWA) for ``num_tokens`` tokens, lent to the caller
        (no eviction); returns the full slot ids (``swa_slots`` maps them). The caller
        gives them back with ``insert`` or ``free_slots``. Raises ``OutOfCapacity``
        (nothing taken) if either pool has too few free pages."""
        check_count(num_tokens, "alloc_slots' num_tokens")
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
        check_count(full_tokens, "evict's full_tokens")
        check_count(swa_tokens, "evict's swa_tokens")
        ps = self.page_size
        full, swa, nodes, tombs = self.tree.evict(-(-full_tokens // ps), -(-swa_tokens // ps))
        return SwaEvictResult(full * ps, nodes, swa * ps, tombs)

    # ---- eviction as the lockstep asks for it (per pool: full, SWA) ----------------------
    @property
    def eviction_ask(self) -> tuple[int, int]:
        """(full, SWA) pages that the last ``admit`` or ``extend`` asked the eviction for
        (zeros if it evicted nothing). The SWA order runs only after the full one, so the
        counts evicted cannot replay a decision (an SWA-only ask deletes leaves, which
        frees full pages too): a rank repeats the ask, ``evict_pages(eviction_ask)``."""
        return self._ask

    def evictable_pages(self) -> tuple[int, int]:
        """(full, SWA) pages that eviction could free now. Pure."""
        t = self.tree
        return (t.cached_pages - t.protected_pages, t.swa_pages - t.swa_protected)

    def evict_pages(self, asks: tuple[int, ...]) -> tuple[int, int]:
        """Evict as an ``admit``/``extend`` asking ``asks`` (full, SWA) pages does; returns
        the pages freed per pool. For the lockstep (asks already agreed; not validated)."""
        full, swa, _, _ = self.tree.evict(asks[0], asks[1] if len(asks) > 1 else 0)
        return full, swa

    def eviction_marks(self) -> tuple[int, int]:
        """(full, SWA) pages evicted so far (counters that only grow, reset included)."""
        return self.tree.evicted_pages, self.tree.evicted_swa_pages

    def _node(self, handle: SwaHandle) -> SwaNode:
        if (
            type(handle) is not SwaHandle
            or type(handle.node_id) is not int
            or type(handle.swa_boundary) is not int
        ):
            raise UnknownHandle(f"not a handle of a hybrid cache: {handle!r}")
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

    # ---- whole-cache --------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cached prefix and running request; announce ``AllBlocksCleared``."""
        events = self.tree.events
        self.alloc.reset()
        self.tree._clear()
        self.reqs = ReqTable()
        self._tops = {}
        self._handle_locks = {}
        self._ask = (0, 0)
        self._owner = new_owner()
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

    def request_row(self, rid: RequestId) -> RequestRow:
        """Running request ``rid`` (read-only views). Raises ``UnknownRequest``, or
        ``CacheError`` for a malformed id."""
        return self.reqs.row(rid, self.page_size)

    def running_ids(self) -> list[RequestId]:
        """The running requests' ids, in admission order."""
        return self.reqs.ids()

    def pool_sizes(self) -> tuple[CacheSizes, CacheSizes]:
        """``sizes()`` per pool: (full, SWA)."""
        s = self.sizes()
        return s.full, s.swa

    def digest(self) -> int:
        """64-bit digest as ``RadixCache.digest`` (cached contents and their full pages,
        ownership, locks, requests, node count, the policy tick and FIFO positions), over
        both pools, with the SWA locks and tombstones. SWA pages enter through the SWA
        pool's free count, head and log of free groups (which node holds which SWA page
        is left out: it would cost a lookup per change). Costs O(1) beyond hashing what waits."""
        t = self.tree
        hash_pending(t)
        return fold_fields(
            fmix64_int(t.digest_sum ^ 0x5A17),
            (
                *self.alloc.fingerprint(),
                t.tick,
                len(t.nodes),
                t.protected_pages,
                len(self.reqs),
                t.swa_protected,
                t.tombstone_pages,
                t.tombstones,
            ),
        )

    def check_integrity(self) -> None:
        """Verify the conservation law per pool, both pools and the mapping, the tree (see
        ``swa_check.check_tree``) and every request row and lock boundary.

        Raises ``IntegrityError`` with the numbers. Costs a full walk: for tests and idle.
        """
        hash_pending(self.tree)
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
        check_requests(self.tree, self.reqs, self._tops)
        check_locks(self.tree, self.reqs, self._tops, self._handle_locks)


__all__ = ["HybridCache", "HybridEvictor", "StaleBoundary"]
