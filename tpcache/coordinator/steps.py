"""The step pipeline under the coordinator: the pending step, the steps in flight, the
check of every rank's result against the mirror, and failing and recovering the group.

A call's ops join the pending step; the step is sent to every rank when the call
returns (or when a ``batch()`` block ends, or the step is full). Up to ``max_inflight``
steps run ahead; each rank's result (its digest and what each op returned) is compared
with the mirror's, and a difference is a divergence. A failed or diverged step stops the
group: the running requests are lost (later calls for them raise ``RequestLost``) and,
if configured, the group is rebuilt at once. ``core.Coordinator`` puts the frontend API
on top.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tpcache.cache.radix import RadixCache
from tpcache.coordinator.api import CoordinatorUnavailable, RequestLost
from tpcache.workers.lockstep import DivergenceError, LockstepError, RankFailure
from tpcache.workers.ops import Op, OpResult, Step, decode_result, encode

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


class StepDriver:
    """The step machinery under ``Coordinator``: the pending step, the steps in flight,
    checking every rank's result against the mirror, and failing and recovering the group.

    A base class rather than a member because the frontend API and this machinery share
    one state (the mirror, which recovery may replace; the pending ops; the broken flag)
    and one caller; split only so that each file reads as one part. Not thread-safe.

    Order kept: steps are numbered from 0 (again after a recovery) and sent in number
    order; results are taken in the same order (``_inflight`` is a FIFO); at most
    ``max_inflight`` are in flight.
    """

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

    def _forget_lost(self, rid: Any) -> None:
        """A request admitted again is no longer lost."""
        if _hashable(rid):
            self._lost.pop(rid, None)


def _hashable(rid: Any) -> bool:
    return isinstance(rid, int | str)
