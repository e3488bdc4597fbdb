"""``Cache``: what every cache kind offers, and all that the layers above may ask of one
besides its parts (``parts.py``: ``SwaPart``, ``HostPart``).

``RadixCache`` (one pool), ``HybridCache`` (a full and a sliding-window pool) and
``HostCache`` (one pool and a host tier) implement ``Cache``, through one
implementation (``prefix.PrefixCache``). Quantities that differ by pool are data, never
a kind test: per-pool figures are tuples in ``pool_names`` order (``("full",)`` or
``("full", "SWA")``). The sliding window and the host tier are parts a cache is built
with, not calls every cache answers: ``cache.swa`` is its ``SwaPart`` (``None`` without
an SWA pool) and ``cache.host`` its ``HostPart`` (``None`` without a host tier), so a
caller asks a part only where there is one, and a cache built without it has none of
its calls. Callers never reach into a cache's tree, request table or allocator.

Every call validates its input before it changes anything and raises a ``CacheError``
subclass (``errors.py``) otherwise; "Pure" means it changes nothing. Slots are token
positions in a pool: slot ``s`` is offset ``s % page_size`` of page ``s // page_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from tpcache.cache.events import KVEvent
from tpcache.cache.keys import TokenLike
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.parts import HostPart, SwaPart
from tpcache.cache.records import (
    AdmitResult,
    CacheSizes,
    CacheStats,
    EvictResult,
    Handle,
    MatchResult,
    RequestId,
    RequestRow,
)

# The ``evict`` callback of admit/extend: called with the local shortfall of each pool,
# in pages, once the match is locked; evicts what it decides (e.g. what the op log says).
Evictor = Callable[..., object]
# admit/extend's ``evict``: True, evict the shortfall in policy order; False, refuse
# (``OutOfCapacity``) what does not fit the free pages; an ``Evictor``, call it.
EvictArg = bool | Evictor


class Cache(Protocol):
    """The cache state machine: a deterministic function of the op sequence (the same ops
    give the same state, slot ids and digest in every process), conserving per pool
    (``free + evictable + protected + held == capacity``)."""

    config: Any  # the frozen configuration it was built from (``CacheConfig``, ``HybridConfig``)
    page_size: int

    # ---- what kind ----------------------------------------------------------------------
    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools, in the order of every per-pool tuple: ``("full",)`` or ``("full",
        "SWA")``."""
        ...

    @property
    def num_pools(self) -> int: ...

    # ---- the parts it was built with (``parts.py``) ---------------------------------------
    @property
    def swa(self) -> SwaPart | None:
        """The sliding window's calls (an SWA pool beside the full one); ``None``: none."""
        ...

    @property
    def host(self) -> HostPart | None:
        """The host tier's calls (a host pool and its copy log); ``None``: none."""
        ...

    # ---- requests -----------------------------------------------------------------------
    def admit(
        self,
        rid: RequestId,
        tokens: TokenLike,
        priority: int = 0,
        *,
        evict: EvictArg = True,
        reserve: int = 0,
        namespace: CacheNamespace | None = None,
    ) -> AdmitResult:
        """Start request ``rid``: match its prompt (at most ``len - 1`` tokens, in whole
        pages; with a window, only where its last window has SWA KV), lock the match,
        evict each pool's shortfall (if ``evict``) and allocate the rest, with slots for
        ``reserve`` tokens past the prompt in the same allocation (``num_tokens`` counts
        them). ``evict`` may be an ``Evictor``, called once after the lock (even when
        nothing is short); then ``OutOfCapacity`` can come after the match, and the lock
        is released again. Otherwise raises before changing anything:
        ``DuplicateRequest``, ``InvalidTokens`` (empty, malformed, over the request limit
        with the reserve), ``OutOfCapacity``, ``CacheError`` (a bad id, priority or
        reserve), ``InvalidNamespace``. With a window the result carries ``swa_pages``
        from ``swa_start``. ``namespace`` (``namespace.CacheNamespace``: a LoRA adapter,
        a tenant's cache salt) keys the KV besides the tokens: the request matches, and
        its finish and ``cache_unfinished`` cache, only in that namespace (equal tokens
        in another never share KV; block hashes differ). ``None``: the default one.
        With a host tier the namespace holds on the host too: a host hit is one in the
        request's namespace."""
        ...

    def extend(self, rid: RequestId, n: int, *, evict: EvictArg = True) -> np.ndarray:
        """``n`` more slots for ``rid`` (decode or a prefill chunk); returns their full-pool
        slot ids. Evicts as ``admit``. Raises (changing nothing) ``UnknownRequest``,
        ``InvalidTokens`` past the request limit, ``OutOfCapacity``, ``CacheError``."""
        ...

    def cache_unfinished(self, rid: RequestId, tokens: TokenLike) -> int:
        """Cache the whole pages of a running request's tokens so far (chunked prefill):
        ``tokens`` must extend those it was given and have KV (at most the slots it
        holds). Duplicates are freed, its row is rewritten to the tree's pages and its
        lock moves to the new last node. Returns the cached length. Raises
        ``UnknownRequest``, ``InvalidTokens``."""
        ...

    def finish(self, rid: RequestId, output_tokens: TokenLike = ()) -> int:
        """End ``rid``: cache the whole pages of its tokens plus ``output_tokens`` that have
        KV, free duplicates and the partial tail, unlock. Returns the cached length."""
        ...

    def abort(self, rid: RequestId) -> None:
        """End ``rid`` without caching anything: free its own pages and unlock."""
        ...

    def request_row(self, rid: RequestId) -> RequestRow:
        """Running request ``rid`` (read-only views, valid until it next changes): its
        tokens, pages, slots (``.slots``), held and cached counts. Pure; raises
        ``UnknownRequest`` or ``CacheError`` for a malformed id."""
        ...

    def running_ids(self) -> list[RequestId]:
        """The running requests' ids, in admission order. Pure."""
        ...

    def is_running(self, rid: object) -> bool:
        """Whether ``rid`` is a running request. Pure; never raises (a malformed or
        unhashable id is not running)."""
        ...

    # ---- prefixes, handles, lent slots --------------------------------------------------
    def admit_prefix_len(self, tokens: TokenLike, namespace: CacheNamespace | None = None) -> int:
        """How many leading tokens of prompt ``tokens`` an ``admit`` would take from the
        cache now (at most ``len - 1``, in whole pages). Pure: no split, no access tick,
        so a scheduler may ask before it decides (the answer holds until the cache next
        changes), in ``namespace`` as ``admit``. Raises ``InvalidTokens``,
        ``InvalidNamespace``."""
        ...

    def match_prefix(
        self, tokens: TokenLike, namespace: CacheNamespace | None = None
    ) -> MatchResult:
        """The longest cached prefix of ``tokens`` in ``namespace`` (as ``admit``) a match
        may end at, in whole pages, with a handle to lock it. May split a node and
        advances the access clock; never changes slot ownership. Raises
        ``InvalidTokens``, ``InvalidNamespace``."""
        ...

    def lock(self, handle: Handle) -> None:
        """Protect ``handle``'s prefix from eviction (with a window: the SWA KV of its
        last window too); locks nest. Raises ``UnknownHandle`` (another cache's, from
        before a reset, forged, naming a namespace anchor, or evicted), ``StaleBoundary``,
        or ``LockError`` if its window lost SWA KV since the match."""
        ...

    def unlock(self, handle: Handle) -> None:
        """Undo one ``lock(handle)``. Raises as ``lock``, or ``LockError`` if this handle
        holds no lock (a running request's lock on the same node does not count)."""
        ...

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        """Whole pages (in every pool) for ``num_tokens`` tokens, lent to the caller; no
        eviction. Returns full-pool slot ids. Raises ``OutOfCapacity`` (nothing taken)."""
        ...

    def free_slots(self, slots: TokenLike) -> None:
        """Free pages lent by ``alloc_slots``, given by all their slots. Raises
        ``InvalidSlots`` or ``AllocatorError`` (nothing freed) for pages not lent."""
        ...

    def insert(
        self,
        tokens: TokenLike,
        slots: TokenLike,
        priority: int = 0,
        namespace: CacheNamespace | None = None,
    ) -> int:
        """Cache the whole pages of ``tokens`` held at lent ``slots`` (the tree's own are
        accepted for the cached part) in ``namespace`` (as ``admit``); returns the tokens
        already cached. Slots that duplicate cached pages are freed (with a window they
        may revive a tombstone). Raises ``InvalidSlots`` (nothing changed) for bad or
        foreign slots, or a part that could never be matched; ``InvalidNamespace``."""
        ...

    # ---- eviction -----------------------------------------------------------------------
    def evict(self, num_tokens: int, swa_tokens: int = 0) -> EvictResult:
        """Evict unlocked leaves in policy order until ``num_tokens`` of full KV are freed,
        then (with an SWA pool) SWA KV until ``swa_tokens`` are (tombstoning inner nodes,
        deleting leaves), counting what the first part freed; less if less is evictable.
        Raises ``CacheError`` for a bad count, ``NoSwaPool`` for ``swa_tokens`` without
        an SWA pool."""
        ...

    @property
    def eviction_ask(self) -> tuple[int, ...]:
        """Pages per pool the last ``admit``/``extend`` asked its eviction for (zeros if
        it evicted nothing): ``evict_pages(eviction_ask)`` on a cache in the state that
        call left after its lock evicts exactly the same nodes."""
        ...

    def evictable_pages(self) -> tuple[int, ...]:
        """Pages per pool eviction could free now. Pure."""
        ...

    def evict_pages(self, asks: tuple[int, ...]) -> tuple[int, ...]:
        """Evict as an admit asking ``asks`` pages per pool does; returns the pages freed
        per pool. For the lockstep: ``asks`` are agreed already, not validated."""
        ...

    def eviction_marks(self) -> tuple[int, ...]:
        """Pages evicted per pool since creation (only grow, across reset too). Pure."""
        ...

    # ---- the whole cache ----------------------------------------------------------------
    def sizes(self) -> CacheSizes:
        """Token counts of the full pool (``HybridSizes`` adds the SWA pool's). Pure."""
        ...

    def pool_sizes(self) -> tuple[CacheSizes, ...]:
        """Token counts per pool. Pure."""
        ...

    def stats(self) -> CacheStats:
        """Eviction counters since creation (statistics, never a decision). Pure."""
        ...

    def evict_seconds(self, last: int | None = None) -> list[float]:
        """Wall-clock seconds of the last ``last`` evict calls (``None``: all kept, at
        least the last 10,000), oldest first, in a new list. Pure."""
        ...

    def digest(self) -> int:
        """64-bit digest of the cached contents and their slots, page ownership and the
        free order of every pool, locks, running requests, node count and the clocks that
        order what comes next. Equal ops give equal digests; any difference changes it
        (whp); a reset cache has a fresh one's. O(1) beyond hashing what waits."""
        ...

    def check_integrity(self) -> None:
        """Verify conservation per pool, the allocator, the tree and every request row and
        lock; raise ``IntegrityError`` with the numbers. A full walk: tests and idle."""
        ...

    def reset(self) -> None:
        """Drop every cached prefix and running request (handles given out before name
        nothing after); announce ``AllBlocksCleared`` if recording events."""
        ...

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (empty unless ``record_events``)."""
        ...

    def put_back_events(self, events: list[KVEvent]) -> None:
        """Queue ``events`` (taken from this cache or another, e.g. the one it replaces)
        ahead of this cache's own: the next ``take_events`` returns them first."""
        ...
