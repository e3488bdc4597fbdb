"""The coordinator: the frontend API over the step pipeline it holds (``steps.StepPipeline``).

Every call is applied first to the coordinator's own mirror of the cache (no tensors).
The mirror validates it (a rejected call raises a typed error and enters no log) and
gives the answer at once, as a record (``records``) that carries all a frontend replies
with; the call's ops join the pending step, which the pipeline sends to every rank and
checks against the mirror.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, overload

from tpcache.cache.errors import CacheError, OutOfCapacity
from tpcache.cache.keys import TokenLike, as_tokens
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.protocol import Cache
from tpcache.cache.reqtable import check_count, check_request_id
from tpcache.coordinator.call_lock import CallLock
from tpcache.coordinator.copy_agree import CopiesNotDone, wait_ready
from tpcache.coordinator.records import Admission, Cached, Extension, admission, cached, extension
from tpcache.coordinator.recovery import Recovery
from tpcache.coordinator.stats import LastFigures, group_figures
from tpcache.coordinator.step_types import (
    CoordinatorConfig,
    Counters,
    RankCallError,
    RankTransport,
    StepObserver,
)
from tpcache.coordinator.steps import StepPipeline
from tpcache.events.publisher import EventPublisher
from tpcache.lockstep.oplog import evict_result, logged_admit, logged_extend, logged_finish
from tpcache.lockstep.ops import (
    Abort,
    CacheUnfinished,
    Evict,
    OpResult,
    Reset,
    pack_tokens,
)
from tpcache.workers.protocol import LockstepError

# Defined in records.py and step_types.py; importable from here too, where the
# coordinator's users find them.
__all__ = [
    "Admission",
    "Cached",
    "Coordinator",
    "CoordinatorConfig",
    "Extension",
    "RankCallError",
    "RankTransport",
    "StepObserver",
]

T = TypeVar("T")


class Held(Generic[T]):
    """An attribute of the coordinator that its step pipeline holds (``path`` from it,
    e.g. ``"lost.restart_note"``): one owner, read through here; written through here
    too where ``settable``, else writing raises ``AttributeError`` as a read-only
    property does."""

    def __init__(self, path: str, settable: bool = False) -> None:
        owner, _, self.name = ("steps." + path).rpartition(".")
        self._get = operator.attrgetter("steps." + path)  # read on every call: one C call
        self._owner = operator.attrgetter(owner)
        self.settable = settable

    @overload
    def __get__(self, coord: None, cls: type | None = None) -> Held[T]: ...

    @overload
    def __get__(self, coord: object, cls: type | None = None) -> T: ...

    def __get__(self, coord: object, cls: type | None = None) -> T | Held[T]:
        return self if coord is None else self._get(coord)

    def __set__(self, coord: object, value: T) -> None:
        if not self.settable:
            raise AttributeError(f"the coordinator's {self.name} cannot be set")
        setattr(self._owner(coord), self.name, value)


class Coordinator:
    """Drives one TP group through its step pipeline (``steps``). Thread-safe: every
    call holds ``lock`` (its callers may hold it around several calls too, as
    ``batch()`` does); what reads the coordinator's state from another thread (a metrics
    scrape, a health check) goes through these calls, never to the mirror directly.

    ``publisher`` (the KV-event publisher), ``event_stats`` (its published/dropped event
    counts) and ``metrics_port`` come from whoever built the group's endpoints
    (``build.build_coordinator``); stats() reports them and close() closes the publisher.
    """

    def __init__(
        self,
        ranks: RankTransport,
        mirror: Cache,
        config: CoordinatorConfig | None = None,
        observers: list[StepObserver] | None = None,
        *,
        publisher: EventPublisher | None = None,
        event_stats: Callable[[], tuple[int, int]] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        config = config or CoordinatorConfig()
        self.steps = StepPipeline(ranks, mirror, config, list(observers or []))
        self.publisher = publisher
        self.event_stats = event_stats
        self.metrics_port = metrics_port
        self._figures = LastFigures()

    # The pipeline's state, as the coordinator's users read it (one owner: the pipeline).
    lock = Held[CallLock]("lock")  # every call holds it; hold it to keep calls together
    ranks = Held[RankTransport]("ranks")
    mirror = Held[Cache]("mirror")  # the coordinator's mirror (recovery may replace it)
    config = Held[CoordinatorConfig]("config", settable=True)
    counters = Held[Counters]("counters")
    observers = Held[list[StepObserver]]("observers")
    broken = Held[LockstepError | None]("recovery.broken")
    recovery = Held[Recovery]("recovery.state")
    recovering = Held[bool]("recovery.recovering")  # the ranks are being rebuilt now
    restart_note = Held[str | None]("lost.restart_note", settable=True)

    def batch(self):
        """Group every call made inside the block into one step."""
        return self.steps.batch()

    def flush(self) -> None:
        self.steps.flush()

    def sync(self) -> None:
        """Send what is pending and wait until every rank has applied and matched it."""
        self.steps.sync()

    def recover(self) -> None:
        self.steps.recovery.recover()

    def wait_ready(self, request_ids: list[Any], timeout: float = 60.0) -> None:
        """Return once every one of the running ``request_ids`` may run its forward: with
        a host tier, once the loads into its row's pages (its prefix, or one another
        request is loading) are agreed done on every rank and the ranks know it. A
        write-back still reading a page it was given is not waited for here: each rank's
        forward waits for its own copy engine (``host_cache.py``).
        Returns at once without a host tier. Raises ``CopiesNotDone`` after ``timeout``
        (nothing changed), or a failed step's error (a failed copy fails the group)."""
        with self.lock:
            wait_ready(self.steps, [check_request_id(r) for r in request_ids], timeout)

    def ready_or_abort(self, request_id: Any) -> None:
        """Return once running ``request_id``'s forward may run (see ``wait_ready``; at once
        without a host tier or a load it waits for), waiting at most ``step_timeout_s``.
        If its loads are not agreed done by then (a rank's copies are stuck), abort it (as
        ``abort``) and raise ``CopiesNotDone``; else raises as ``wait_ready``."""
        with self.lock:
            rid = check_request_id(request_id)
            host = self.mirror.host
            if host is None:  # no copies to wait for: only a running request is asked for
                self.mirror.request_row(rid)
                return
            if host.request_ready(rid):
                return
            try:
                wait_ready(self.steps, [rid], self.config.step_timeout_s)
            except CopiesNotDone as exc:
                self.abort(rid)
                raise CopiesNotDone(f"request {request_id!r} aborted: {exc}") from None

    def stop_recovery(self) -> None:
        self.steps.recovery.stop()

    def check_health(self) -> bool:
        return self.steps.recovery.check_health()

    # ---- the frontend API ------------------------------------------------------------------
    def admit(
        self,
        request_id: Any,
        tokens: TokenLike,
        priority: int = 0,
        reserve: int = 0,
        namespace: CacheNamespace | None = None,
    ) -> Admission:
        """Admit a request; returns its cached prefix length and the slots of its prompt
        and of ``reserve`` more tokens (see ``RadixCache.admit``), and a hybrid cache's
        SWA slots from the prefix's end, matched and later cached in ``namespace`` (a
        LoRA adapter, a tenant's salt; ``None``: the default).

        Raises (before anything is logged) the cache's typed errors: DuplicateRequest,
        InvalidTokens, OutOfCapacity, InvalidNamespace, CacheError for a bad id, priority
        or reserve.
        """

        def run() -> Admission:
            rid = check_request_id(request_id)
            got, op, expected = logged_admit(self.mirror, rid, tokens, priority, reserve, namespace)
            self.steps.lost.forget(rid)
            self.steps.emit(op, expected)
            c = self.counters
            c.queries += 1
            c.query_tokens += len(op.tokens) // 4  # int32 tokens
            c.hit_tokens += got.prefix_len
            return admission(self.mirror, rid, got)

        return self.steps.run(run)

    def extend(self, request_id: Any, n: int) -> Extension:
        """``n`` more slots for a running request (decode, or the next prefill chunk), and
        a hybrid cache's SWA slots from the first of them. Raises as the cache's
        ``extend`` (nothing changed), or ``RequestLost``."""

        def run() -> Extension:
            rid = self._running_id(request_id)
            slots, op, expected = logged_extend(self.mirror, rid, n)
            self.steps.emit(op, expected)
            return extension(self.mirror, rid, slots)

        return self.steps.run(run)

    def extend_each(self, request_ids: Sequence[Any], n: int) -> int:
        """``extend(rid, n)`` of each running request in order, as one call (a decode
        step's slots: one lock, one pass), stopping at the first the cache has no room
        for; returns how many were extended (their slots: ``mirror.request_row``).
        Raises as ``extend`` for anything else, the requests before it extended."""

        def run() -> int:
            done = 0
            for request_id in request_ids:
                rid = self._running_id(request_id)
                try:
                    _slots, op, expected = logged_extend(self.mirror, rid, n)
                except OutOfCapacity:
                    return done
                self.steps.emit(op, expected)
                done += 1
            return done

        return self.steps.run(run)

    def cache_unfinished(self, request_id: Any, tokens: TokenLike) -> Cached:
        """Cache a running request's whole pages so far (chunked prefill). Returns the
        cached length and, when pages the tree already held replaced the request's own,
        its row now and the slots freed. Raises as the cache's ``cache_unfinished``
        (nothing changed), or ``RequestLost``."""

        def run() -> Cached:
            rid = self._running_id(request_id)
            key = as_tokens(tokens)
            before = self.mirror.request_row(rid).pages.copy()
            n = self.mirror.cache_unfinished(rid, key)
            self.steps.emit(CacheUnfinished(rid, pack_tokens(key)), OpResult(prefix_len=n))
            return cached(self.mirror, rid, n, before)

        return self.steps.run(run)

    def finish(self, request_id: Any, output_tokens: TokenLike = ()) -> int:
        """Finish a request: cache its prompt and ``output_tokens`` (whole pages with KV).

        Every output token is validated; only those that have slots (and so can be
        cached) travel to the ranks: an output longer than the request's KV costs the
        ranks nothing."""

        def run() -> int:
            rid = self._running_id(request_id)
            n, op, expected = logged_finish(self.mirror, rid, output_tokens)
            self.steps.emit(op, expected)
            return n

        return self.steps.run(run)

    def abort(self, request_id: Any) -> None:
        """Drop a running request without caching it."""

        def run() -> None:
            rid = self._running_id(request_id)
            self.mirror.abort(rid)
            self.steps.emit(Abort(rid), OpResult())

        self.steps.run(run)

    def evict(self, num_tokens: int, swa_tokens: int = 0) -> int:
        """Evict at least ``num_tokens`` of full KV if that much is evictable, then (hybrid
        cache) at least ``swa_tokens`` of SWA KV, counting what the first part freed;
        returns full-KV tokens evicted. Raises ``CacheError`` for a bad count, or SWA
        tokens asked of a cache without an SWA pool, before anything changes."""

        def run() -> int:
            check_count(num_tokens, "evict's num_tokens")
            check_count(swa_tokens, "evict's swa_tokens")
            pools = len(self.mirror.evictable_pages())
            if swa_tokens and pools < 2:
                raise CacheError("swa_tokens needs the hybrid cache (this one has no SWA pool)")
            ps = self.mirror.page_size
            asks = (-(-num_tokens // ps), -(-swa_tokens // ps))[:pools]
            freed = self.mirror.evict_pages(asks)
            self.steps.emit(Evict(num_tokens, swa_tokens), evict_result(freed))
            return freed[0] * ps

        return self.steps.run(run)

    def reset(self) -> None:
        """Drop every cached prefix and running request on every rank (a cache flush)."""

        def run() -> None:
            self.mirror.reset()
            self.steps.emit(Reset(), OpResult())

        self.steps.run(run)

    def _running_id(self, request_id: Any) -> Any:
        """The plain id of a call on a running request; raises ``RequestLost`` for one lost
        to a failure, ``CacheError`` for a malformed id (nothing changed either way)."""
        rid = check_request_id(request_id)
        self.steps.lost.check(rid, self.mirror.is_running(rid))
        return rid

    def stats(self, wait_s: float = 1.0) -> dict[str, Any]:
        """The group's figures (a new dict; changes no cache state). Taken under ``lock``;
        if another call holds it longer than ``wait_s`` (a step waiting for a slow rank),
        the figures of the last ``stats()`` are returned, ``stats_age_s`` saying how old."""
        return self._figures.take(
            self.lock,
            wait_s,
            lambda: group_figures(self.steps, self.event_stats, self.metrics_port),
        )

    def request_limit(self) -> int:
        """The most tokens one request may hold (a recovery to another capacity may
        change it). Changes nothing."""
        with self.lock:
            return self.mirror.config.request_limit

    def close(self) -> None:
        """Stop the ranks, the event publisher and the metrics endpoint. Idempotent. Waits
        a moment for a call in progress (not for a hung one)."""
        held = self.lock.acquire(timeout=5.0)
        try:
            self._close()
        finally:
            if held:
                self.lock.release()

    def _close(self) -> None:
        self.steps.closed = True
        self.ranks.close()
        for obs in self.observers:
            close = getattr(obs, "close", None)
            if close is not None:
                close()
        if self.publisher is not None:
            self.publisher.close()
