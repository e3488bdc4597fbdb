"""The coordinator: the frontend API over the step pipeline it holds (``steps.StepPipeline``).

Every call is applied first to the coordinator's own mirror of the cache (no tensors).
The mirror validates it (a rejected call raises a typed error and enters no log) and
gives the answer at once; the call's ops join the pending step, which the pipeline sends
to every rank and checks against the mirror.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tpcache.cache.errors import CacheError
from tpcache.cache.keys import TokenLike, as_tokens
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import AdmitResult
from tpcache.cache.reqtable import check_count, check_request_id
from tpcache.cache.tallies import host_figures
from tpcache.coordinator.call_lock import CallLock
from tpcache.coordinator.copy_agree import wait_ready
from tpcache.coordinator.step_types import (
    CoordinatorConfig,
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

# Defined in step_types.py; importable from here too, where the coordinator's users find them.
__all__ = [
    "Admission",
    "Coordinator",
    "CoordinatorConfig",
    "RankCallError",
    "RankTransport",
    "StepObserver",
]

# An admitted request, as the frontend sees it: the cache's own result record (prefix
# length, the prompt's pages shown read-only, ``slots`` expanded when asked for).
Admission = AdmitResult


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
        self._last_stats: dict[str, Any] | None = None  # under lock: the latest stats()
        self._last_stats_at = 0.0

    # ---- the pipeline's state, as the coordinator's users read it --------------------------
    @property
    def lock(self) -> CallLock:
        """The lock every call holds; hold it to keep several calls together."""
        return self.steps.lock

    @property
    def ranks(self) -> RankTransport:
        return self.steps.ranks

    @property
    def mirror(self) -> Cache:
        """The coordinator's mirror of the cache (recovery may replace it)."""
        return self.steps.mirror

    @property
    def config(self) -> CoordinatorConfig:
        return self.steps.config

    @config.setter
    def config(self, value: CoordinatorConfig) -> None:
        self.steps.config = value

    @property
    def counters(self):
        return self.steps.counters

    @property
    def observers(self) -> list[StepObserver]:
        return self.steps.observers

    @property
    def broken(self):
        return self.steps.broken

    @property
    def recovery(self):
        return self.steps.recovery

    @property
    def restart_note(self) -> str | None:
        return self.steps.lost.restart_note

    @restart_note.setter
    def restart_note(self, value: str | None) -> None:
        self.steps.lost.restart_note = value

    def batch(self):
        """Group every call made inside the block into one step."""
        return self.steps.batch()

    def flush(self) -> None:
        self.steps.flush()

    def sync(self) -> None:
        """Send what is pending and wait until every rank has applied and matched it."""
        self.steps.sync()

    def recover(self) -> None:
        self.steps.recover()

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

    def stop_recovery(self) -> None:
        self.steps.stop_recovery()

    def check_health(self) -> bool:
        return self.steps.check_health()

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
        and of ``reserve`` more tokens (see ``RadixCache.admit``), matched and later
        cached in ``namespace`` (a LoRA adapter, a tenant's salt; ``None``: the default).

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
            return got  # the mirror's own record for this call (its pages read-only)

        return self.steps.run(run)

    def extend(self, request_id: Any, n: int) -> np.ndarray:
        """``n`` more slots for a running request (decode, or the next prefill chunk)."""

        def run() -> np.ndarray:
            rid = self._running_id(request_id)
            slots, op, expected = logged_extend(self.mirror, rid, n)
            self.steps.emit(op, expected)
            return slots

        return self.steps.run(run)

    def cache_unfinished(self, request_id: Any, tokens: TokenLike) -> int:
        """Cache a running request's whole pages so far (chunked prefill); cached length."""

        def run() -> int:
            rid = self._running_id(request_id)
            key = as_tokens(tokens)
            n = self.mirror.cache_unfinished(rid, key)
            self.steps.emit(CacheUnfinished(rid, pack_tokens(key)), OpResult(prefix_len=n))
            return n

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
        if not self.lock.acquire(timeout=wait_s):
            if self._last_stats is not None:
                age = time.monotonic() - self._last_stats_at
                return {**self._last_stats, "stats_age_s": age}
            self.lock.acquire()
        try:
            self._last_stats = self._stats()
            self._last_stats_at = time.monotonic()
            return dict(self._last_stats)
        finally:
            self.lock.release()

    def _stats(self) -> dict[str, Any]:
        c = self.counters
        s = self.mirror.sizes()
        lat = list(c.latencies_s)
        return {
            "tp": self.ranks.world_size,
            "steps_sent": self.steps.steps_sent,
            "steps_done": c.steps_done,
            "messages_sent": c.messages,
            "inflight": self.steps.steps_inflight,
            "waiting": self.steps.steps_waiting,
            "ops": c.ops,
            "queries": c.queries,
            "query_tokens": c.query_tokens,
            "hit_tokens": c.hit_tokens,
            "hit_rate": c.hit_tokens / c.query_tokens if c.query_tokens else 0.0,
            "capacity": s.capacity,
            "free": s.free,
            "evictable": s.evictable,
            "protected": s.protected,
            "held": s.held,
            "running": len(self.mirror.running_ids()),
            "evicted_tokens": self.mirror.stats().evicted_pages[0] * self.mirror.page_size,
            "divergences": c.divergences,
            "rank_failures": c.rank_failures,
            "recoveries": c.recoveries,
            "last_recovery_s": c.last_recovery_s,
            "replaced_ranks": getattr(self.ranks, "replaced", 0),
            "rank_paths": self.ranks.paths(),
            "step_latency_ms_median": statistics.median(lat) * 1e3 if lat else 0.0,
            "digest": self.mirror.digest(),
            "broken": str(self.broken) if self.broken else None,
            # Retried recovery: failed attempts since start, whether attempts go on, the
            # last failure, and seconds to the next attempt (0 when healthy).
            "recovery_failures": self.recovery.failures,
            "recovering": self.steps.recovering
            or (self.broken is not None and self.config.auto_recover and not self.recovery.stopped),
            "last_recovery_error": self.recovery.last_error,
            "next_recovery_in_s": max(0.0, self.recovery.next_at - time.monotonic())
            if self.broken is not None
            else 0.0,
            "events_published": self.event_stats()[0] if self.event_stats else 0,
            "events_dropped": self.event_stats()[1] if self.event_stats else 0,
            "metrics_port": self.metrics_port,
            # A host tier's pool and moves, from the mirror (as evicted_tokens is).
            **host_figures(self.mirror),
            "stats_age_s": 0.0,
        }

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
