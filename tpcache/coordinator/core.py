"""The coordinator: admits frontend calls, keeps the op log, drives the ranks, checks them.

Every call is applied first to the coordinator's own mirror of the cache (no tensors).
The mirror validates it (a rejected call raises a typed error and enters no log) and
gives the answer at once; the call's ops join the pending step. A step is sent to
every rank when the call returns (or when a ``batch()`` block ends, or the step is
full). Up to ``max_inflight`` steps run ahead; each rank's result (its digest and what
each op returned) is compared with the mirror's, and a difference is a divergence.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from tpcache.cache.keys import TokenLike, as_tokens
from tpcache.cache.radix import AdmitResult, RadixCache
from tpcache.coordinator.api import CoordinatorUnavailable, RequestLost
from tpcache.workers.lockstep import (
    DivergenceError,
    LockstepError,
    RankFailure,
    admit_result,
    eviction_marks,
)
from tpcache.workers.ops import (
    Abort,
    Admit,
    CacheUnfinished,
    Evict,
    Extend,
    Finish,
    Op,
    OpResult,
    Reset,
    Step,
    decode_result,
    encode,
    pack_tokens,
)

_T = TypeVar("_T")


class RankCallError(Exception):
    """A rank's call failed: ``rank`` names it, ``cause`` is what it raised (or why it died)."""

    def __init__(self, rank: int, cause: BaseException, dead: bool = False) -> None:
        super().__init__(f"rank {rank}: {type(cause).__name__}: {cause}")
        self.rank = rank
        self.cause = cause
        self.dead = dead


class StepObserver(Protocol):
    """Told of every step: its KV events when it is sent, its latency when verified."""

    def step_sent(self, step: int, events: list) -> None: ...

    def step_done(self, step: int, latency_s: float) -> None: ...


class RankTransport(Protocol):
    """How the coordinator reaches its ranks (Ray actors, or anything with these calls)."""

    world_size: int

    def send(self, data: bytes) -> Any: ...

    def ready(self, ticket: Any) -> bool: ...

    def collect(self, ticket: Any, timeout: float) -> list[bytes]: ...

    def call(self, method: str, *args: Any) -> list[Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class CoordinatorConfig:
    max_inflight: int = 4
    max_batch_ops: int = 1024
    step_timeout_s: float = 120.0
    auto_recover: bool = True  # after a rank failure or divergence, rebuild the group at once
    probe_s: float = 2.0  # a rank that does not answer a ping this fast is replaced

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_batch_ops < 1 or self.step_timeout_s <= 0:
            raise ValueError(f"bad coordinator config {self}")


# An admitted request, as the frontend sees it: the cache's own result record (prefix
# length, the prompt's pages shown read-only, ``slots`` expanded when asked for).
Admission = AdmitResult


@dataclass
class _InFlight:
    step: int
    ticket: Any
    digest: int
    expected: list[OpResult]
    sent_at: float


@dataclass
class _Counters:
    """Owned by the coordinator; read by ``stats()`` and the metrics exporter."""

    steps_done: int = 0
    ops: int = 0
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    divergences: int = 0
    rank_failures: int = 0
    recoveries: int = 0
    # Wall time of the last recover(): mostly a replacement rank's start-up and the join
    # (bounded by the ranks' join timeout), apart from the failure's detection before it.
    last_recovery_s: float = 0.0
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    # Per step, the slowest rank's time on its ops and digest (before the collective).
    rank_ops_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class Coordinator:
    """Drives one TP group. Not thread-safe: one caller (or one actor) at a time."""

    def __init__(
        self,
        ranks: RankTransport,
        mirror: RadixCache,
        config: CoordinatorConfig | None = None,
        observers: list[StepObserver] | None = None,
    ) -> None:
        self.ranks = ranks
        self.mirror = mirror
        self.config = config or CoordinatorConfig()
        self.observers: list[StepObserver] = list(observers or [])
        # Counted by whoever publishes events (EventsHook); read by stats() and metrics.
        self.event_stats: Callable[[], tuple[int, int]] | None = None
        self.publisher: Any = None  # the EventPublisher, when events are on
        self.metrics_port: int | None = None
        self.counters = _Counters()
        self._pending: list[tuple[Op, OpResult]] = []
        self._inflight: deque[_InFlight] = deque()
        self._next_step = 0
        self._batch_depth = 0
        self.broken: LockstepError | None = None
        # Requests that were running when the group failed: id -> why they were lost.
        self._lost: dict[Any, str] = {}
        # Set by a restarted service: every unknown request id may have been lost.
        self.restart_note: str | None = None

    # ---- the frontend API ------------------------------------------------------------------
    def admit(self, request_id: Any, tokens: TokenLike, priority: int = 0) -> Admission:
        """Admit a request; returns its cached prefix length and the slots of its prompt.

        Raises (before anything is logged) the cache's typed errors: DuplicateRequest,
        InvalidTokens, OutOfCapacity, CacheError for a bad id or priority.
        """

        def run() -> Admission:
            key = as_tokens(tokens)
            if _hashable(request_id):
                self._lost.pop(request_id, None)
            full0, swa0 = eviction_marks(self.mirror)
            got = self.mirror.admit(request_id, key, priority)
            full1, swa1 = eviction_marks(self.mirror)
            evicted = full1 - full0
            op = Admit(request_id, pack_tokens(key), priority, evicted, swa1 - swa0)
            self._emit(op, admit_result(got, evicted))
            c = self.counters
            c.queries += 1
            c.query_tokens += int(key.size)
            c.hit_tokens += got.prefix_len
            return Admission(got.prefix_len, got.pages, got.num_tokens, got.page_size)

        return self._run(run)

    def extend(self, request_id: Any, n: int) -> np.ndarray:
        """``n`` more slots for a running request (decode, or the next prefill chunk)."""

        def run() -> np.ndarray:
            self._check_lost(request_id)
            full0, swa0 = eviction_marks(self.mirror)
            slots = self.mirror.extend(request_id, n)
            full1, swa1 = eviction_marks(self.mirror)
            evicted = full1 - full0
            self._emit(
                Extend(request_id, n, evicted, swa1 - swa0),
                OpResult(0, int(slots.size), int(slots.sum()), evicted),
            )
            return slots

        return self._run(run)

    def cache_unfinished(self, request_id: Any, tokens: TokenLike) -> int:
        """Cache a running request's whole pages so far (chunked prefill); cached length."""

        def run() -> int:
            self._check_lost(request_id)
            key = as_tokens(tokens)
            n = self.mirror.cache_unfinished(request_id, key)
            self._emit(CacheUnfinished(request_id, pack_tokens(key)), OpResult(prefix_len=n))
            return n

        return self._run(run)

    def finish(self, request_id: Any, output_tokens: TokenLike = ()) -> int:
        """Finish a request: cache its prompt and ``output_tokens`` (whole pages with KV)."""

        def run() -> int:
            self._check_lost(request_id)
            out = as_tokens(output_tokens, allow_empty=True)
            n = self.mirror.finish(request_id, out)
            self._emit(Finish(request_id, pack_tokens(out)), OpResult(prefix_len=n))
            return n

        return self._run(run)

    def abort(self, request_id: Any) -> None:
        """Drop a running request without caching it."""

        def run() -> None:
            self._check_lost(request_id)
            self.mirror.abort(request_id)
            self._emit(Abort(request_id), OpResult())

        self._run(run)

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` if that much is evictable; returns tokens evicted."""

        def run() -> int:
            got = self.mirror.evict(num_tokens)
            self._emit(
                Evict(num_tokens), OpResult(evicted_pages=got.num_tokens // self.mirror.page_size)
            )
            return got.num_tokens

        return self._run(run)

    def reset(self) -> None:
        """Drop every cached prefix and running request on every rank (a cache flush)."""

        def run() -> None:
            self.mirror.reset()
            self._emit(Reset(), OpResult())

        self._run(run)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group every call made inside the block into one step."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0 and self.broken is None:
                self._send()

    def sync(self) -> None:
        """Send what is pending and wait until every rank has applied and matched it."""
        self._check_usable()
        self._send()
        while self._inflight:
            self._collect_one()

    def stats(self) -> dict[str, Any]:
        c = self.counters
        s = self.mirror.sizes()
        lat = list(c.latencies_s)
        return {
            "tp": self.ranks.world_size,
            "steps_sent": self._next_step,
            "steps_done": c.steps_done,
            "inflight": len(self._inflight),
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
            "running": len(self.mirror.reqs),
            "evicted_tokens": self.mirror.tree.evicted_pages * self.mirror.page_size,
            "divergences": c.divergences,
            "rank_failures": c.rank_failures,
            "recoveries": c.recoveries,
            "last_recovery_s": c.last_recovery_s,
            "replaced_ranks": getattr(self.ranks, "replaced", 0),
            "step_latency_ms_median": statistics.median(lat) * 1e3 if lat else 0.0,
            "digest": self.mirror.digest(),
            "broken": str(self.broken) if self.broken else None,
            "events_published": self.event_stats()[0] if self.event_stats else 0,
            "events_dropped": self.event_stats()[1] if self.event_stats else 0,
            "metrics_port": self.metrics_port,
        }

    def close(self) -> None:
        """Stop the ranks, the event publisher and the metrics endpoint. Idempotent."""
        self.ranks.close()
        for obs in self.observers:
            close = getattr(obs, "close", None)
            if close is not None:
                close()
        if self.publisher is not None:
            self.publisher.close()

    # ---- steps -------------------------------------------------------------------------------
    def _run(self, fn: Callable[[], _T]) -> _T:
        self._check_usable()
        result = fn()
        if self._batch_depth == 0 or len(self._pending) >= self.config.max_batch_ops:
            self._send()
        return result

    def _emit(self, op: Op, expected: OpResult) -> None:
        self._pending.append((op, expected))
        self.counters.ops += 1

    def _send(self) -> None:
        if not self._pending:
            return
        ops = [op for op, _ in self._pending]
        expected = [r for _, r in self._pending]
        self._pending = []
        step = self._next_step
        self._next_step += 1
        data = encode(Step(step, ops))
        events = self.mirror.take_events()
        for obs in self.observers:
            obs.step_sent(step, events)
        while len(self._inflight) >= self.config.max_inflight:
            self._collect_one()
        ticket = self.ranks.send(data)
        self._inflight.append(
            _InFlight(step, ticket, self.mirror.digest(), expected, time.perf_counter())
        )
        # Harvest older steps that are done; the one just sent cannot be (a round trip
        # takes milliseconds), and asking Ray costs the driver about half a millisecond.
        while len(self._inflight) > 1 and self.ranks.ready(self._inflight[0].ticket):
            self._collect_one()

    def _collect_one(self) -> None:
        f = self._inflight.popleft()
        try:
            outs = self.ranks.collect(f.ticket, self.config.step_timeout_s)
        except RankCallError as exc:
            self._fail(f, exc)
        latency = time.perf_counter() - f.sent_at
        self.counters.latencies_s.append(latency)
        for obs in self.observers:
            obs.step_done(f.step, latency)
        odd = []
        ops_s = 0.0
        for out in outs:
            got = decode_result(out)
            ops_s = max(ops_s, got.ops_us * 1e-6)
            if got.digest != f.digest or got.results != f.expected:
                odd.append(got.rank)
        self.counters.rank_ops_s.append(ops_s)
        if odd:
            self.counters.divergences += 1
            self._break(
                DivergenceError(
                    f.step,
                    f"rank(s) {odd} differ from the coordinator's mirror after step {f.step}",
                    tuple(odd),
                )
            )
        self.counters.steps_done += 1

    def _fail(self, f: _InFlight, exc: RankCallError) -> None:
        cause = exc.cause
        if isinstance(cause, DivergenceError):
            self.counters.divergences += 1
            odd = self._odd_ranks(f.digest)
            self._break(DivergenceError(f.step, f"{cause}; odd rank(s): {list(odd)}", odd))
        self.counters.rank_failures += 1
        if isinstance(cause, RankFailure):
            self._break(RankFailure(f.step, str(cause)))
        kind = "died" if exc.dead else "failed"
        self._break(RankFailure(f.step, f"rank {exc.rank} {kind}: {type(cause).__name__}: {cause}"))

    def _odd_ranks(self, mirror_digest: int) -> tuple[int, ...]:
        """Gather every rank's digest; the ranks that differ from the mirror are odd."""
        try:
            digests = self.ranks.call("digest")
        except RankCallError:
            return ()
        return tuple(r for r, d in enumerate(digests) if d != mirror_digest)

    def _break(self, err: LockstepError) -> None:
        """Stop: every running request is lost (with ``err`` as the cause), then recover
        if configured, and raise ``err`` (retryable) to the caller that hit it."""
        self.broken = err
        for rid in self.mirror.reqs.ids():
            self._lost[rid] = str(err)
        while len(self._lost) > 100_000:  # bounded memory of lost ids, oldest first
            del self._lost[next(iter(self._lost))]
        self._inflight.clear()
        self._pending = []
        if self.config.auto_recover:
            try:
                self.recover()
            except Exception as exc:
                err.detail += f"; recovery failed: {type(exc).__name__}: {exc}"
                err.args = (f"step {err.step}: {err.detail}",)
        raise err

    def recover(self) -> None:
        """Replace dead or hung ranks, rebuild the process group, and start every rank and
        the mirror from an empty cache (announced once as ``AllBlocksCleared``).

        Requests that were running are lost: later calls for them raise ``RequestLost``.
        """
        started = time.monotonic()
        for rid in self.mirror.reqs.ids():
            self._lost.setdefault(rid, "the coordinator recovered its TP group")
        self._inflight.clear()
        self._pending = []
        capacity = self.ranks.restart(self.config.probe_s)
        old = self.mirror
        if capacity == old.sizes().capacity:
            old.reset()
        else:
            self.mirror = type(old)(dataclasses.replace(old.config, capacity_tokens=capacity))
            if old.config.record_events:
                old.reset()
                self.mirror.tree.events = old.take_events()
        events = self.mirror.take_events()
        for obs in self.observers:
            obs.step_sent(-1, events)
        self._next_step = 0
        self.broken = None
        self.counters.recoveries += 1
        self.counters.last_recovery_s = time.monotonic() - started

    def check_health(self) -> bool:
        """Ping every rank (bounded by ``probe_s``); on a dead or hung rank, fail and
        recover as a failed step would. Returns True if all were healthy."""
        self._check_usable()
        if self._inflight or self._pending:
            self.sync()  # a failure shows up here, and recovers
            return True
        try:
            self.ranks.call("ping", timeout=self.config.probe_s)
        except RankCallError as exc:
            self.counters.rank_failures += 1
            kind = "died" if exc.dead else "did not answer a health check"
            self._break(RankFailure(self._next_step, f"rank {exc.rank} {kind}: {exc.cause}"))
        return True

    def _check_lost(self, rid: Any) -> None:
        if not _hashable(rid) or rid in self.mirror.reqs:
            return
        why = self._lost.pop(rid, None)
        if why is not None:
            raise RequestLost(f"request {rid!r} was lost ({why}); admit it again")
        if self.restart_note is not None:
            raise RequestLost(
                f"request {rid!r} is unknown: {self.restart_note}, so requests admitted "
                "before then are lost; admit it again"
            )

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise CoordinatorUnavailable(
                f"the TP group stopped at {self.broken}; it must be recovered"
            )


def _hashable(rid: Any) -> bool:
    return isinstance(rid, int | str)
