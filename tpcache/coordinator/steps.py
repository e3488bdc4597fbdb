"""The step pipeline under the coordinator: the pending step, the steps in flight, and the
check of every rank's result against the mirror.

A call's ops join the pending step; the step is closed when the call returns (or when a
``batch()`` block ends, or the step is full) and sent to every rank. Up to
``max_inflight`` messages run ahead; each rank's result for each step (its digest and
what each op returned) is compared with the mirror's, and a difference is a divergence.

Coalescing: while every in-flight slot is taken and the oldest message is not back, a
closed step waits here instead of blocking the caller, and the steps that wait go out
together, in one message per rank, when a slot frees (at most ``coalesce`` of them: then
the caller blocks, as without coalescing). A rank applies them one by one, each step with
its own collectives and digest check, so lockstep is unchanged; what is saved is a
transport round trip per step, which on CPU ranks costs more than a small step's cache
work. A step that waits is sent by the next call, ``flush()`` or ``sync()``; anything
that reaches the ranks directly (a model forward) flushes first.

A failed or diverged step stops the group (``recovery.py``): the running requests are lost
(later calls for them raise ``RequestLost``, ``lost.py``) and, if configured, the group is
rebuilt at once.
``core.Coordinator`` puts the frontend API on top.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

from tpcache.cache.protocol import Cache
from tpcache.coordinator.call_lock import CallLock
from tpcache.coordinator.copy_agree import CopyCompletion
from tpcache.coordinator.lost import LostRequests
from tpcache.coordinator.recovery import GroupRecovery
from tpcache.coordinator.step_check import odd_by_digest, odd_ranks
from tpcache.coordinator.step_types import (
    Closed,
    CoordinatorConfig,
    Counters,
    InFlight,
    RankCallError,
    RankTransport,
    StepObserver,
)
from tpcache.lockstep.ops import Op, OpResult, Step, encode
from tpcache.workers.protocol import DivergenceError, RankFailure

_T = TypeVar("_T")


class StepPipeline:
    """The step machinery a ``Coordinator`` holds: the pending step, the steps in flight,
    and checking every rank's result against the mirror; ``recovery`` fails and recovers
    the group.

    It owns the mirror (recovery may replace it) and the pending ops; the
    coordinator's API applies each call to ``mirror`` inside ``run`` and logs its ops
    with ``emit``. Every entry point holds ``lock`` (any thread may call); a recovery
    lets go of it while the ranks are rebuilt, so other callers get
    ``CoordinatorUnavailable`` at once instead of waiting for it.

    Order kept: steps are numbered from 0 (again after a recovery) and sent in number
    order; results are taken in the same order (``_inflight`` is a FIFO of messages, and
    ``_waiting`` holds closed steps not sent yet); at most ``max_inflight`` messages are in
    flight and ``coalesce`` steps wait.
    """

    def __init__(
        self,
        ranks: RankTransport,
        mirror: Cache,
        config: CoordinatorConfig,
        observers: list[StepObserver],
    ) -> None:
        self.ranks = ranks
        self.mirror = mirror
        self.config = config
        self.observers = observers  # the pipeline's own list (the coordinator made it)
        self.counters = Counters()
        self._pending: list[tuple[Op, OpResult]] = []
        self._inflight: deque[InFlight] = deque()
        self._waiting: list[Closed] = []  # closed steps not yet sent (see coalescing)
        self._next_step = 0
        self._batch_depth = 0
        self.lost = LostRequests()  # owned here: what a failure or a recovery lost
        self.copies = CopyCompletion()  # the host tier's agreed copy completion
        self.lock = CallLock()
        self.closed = False  # set by the coordinator's close(): a rebuild then stops
        self.recovery = GroupRecovery(self)  # whether the group is broken; bringing it back

    @property
    def next_step(self) -> int:
        return self._next_step

    @property
    def idle(self) -> bool:
        """No step pending, waiting or in flight."""
        return not (self._inflight or self._waiting or self._pending)

    @property
    def steps_sent(self) -> int:
        return self._next_step - len(self._waiting)

    @property
    def steps_inflight(self) -> int:
        return sum(len(f.steps) for f in self._inflight)

    @property
    def steps_waiting(self) -> int:
        return len(self._waiting)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group every call made inside the block into one step (holding ``lock``)."""
        with self.lock:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
                if self._batch_depth == 0 and self.recovery.broken is None:
                    self._send()

    def flush(self) -> None:
        """Send every closed or pending step now (waiting only for a free in-flight slot),
        so that a call that reaches the ranks next comes after them."""
        with self.lock:
            self.recovery.check_usable()
            self._send()
            if self._waiting:
                self._post()

    def sync(self) -> None:
        """Send what is pending and wait until every rank has applied and matched it."""
        with self.lock:
            self.flush()
            while self._inflight:
                self._collect_one()

    # ---- steps -------------------------------------------------------------------------------
    def run(self, fn: Callable[[], _T]) -> _T:
        """Run a call (``fn`` applies it to the mirror and emits its ops); its step is
        closed unless a ``batch()`` is open."""
        with self.lock:
            self.recovery.check_usable()
            self._pending += self.copies.completion(self.mirror)
            result = fn()
            if self._batch_depth == 0 or len(self._pending) >= self.config.max_batch_ops:
                self._send()
            return result

    def emit(self, op: Op, expected: OpResult) -> None:
        """Log ``op`` in the pending step; every rank must answer ``expected``."""
        self._pending.append((op, expected))
        self.counters.ops += 1

    def _send(self) -> None:
        """Close the pending step and send it, or let it wait (see coalescing)."""
        if not self._pending:
            return
        self._pending += self.copies.completion(self.mirror)
        self._pending += self.copies.sync_op(self.mirror, self._pending)
        ops = [op for op, _ in self._pending]
        expected = [r for _, r in self._pending]
        self._pending = []
        step = self._next_step
        try:
            data = encode(Step(step, ops, peer_check=self.ranks.peer_check))
        except Exception as exc:  # every input is validated first: this is a bug
            # The mirror took ops the ranks can never get: start over, as for a failure.
            self.recovery.fail(RankFailure(step, f"step could not be encoded: {exc}"))
        self._next_step += 1
        events = self.mirror.take_events()
        for obs in self.observers:
            obs.step_sent(step, events)
        closed = Closed(step, data, 0, expected, time.perf_counter())
        self._waiting.append(closed)
        # Every slot taken: the step waits (the caller goes on) unless ``coalesce`` steps
        # wait already or the oldest message is back; ``_post`` then blocks for a slot.
        # Whether it is back is asked only then, since asking costs the transport a poll
        # (results are checked later, at most max_inflight messages on).
        cfg = self.config
        waits = (
            len(self._inflight) >= cfg.max_inflight
            and len(self._waiting) < cfg.coalesce
            and not self.ranks.ready(self._inflight[0].ticket)
        )
        if not waits:
            self._post()
        # Taken after the send, while the ranks apply the step: the mirror has not changed
        # since the step closed, and a digest hashes the new nodes, which an unpipelined
        # step need not wait for. Results are checked only later.
        closed.digest = self.mirror.digest()

    def _post(self) -> None:
        """Send every waiting step in one message, once an in-flight slot is free."""
        while len(self._inflight) >= self.config.max_inflight:  # the config may have shrunk
            self._collect_one()
        steps, self._waiting = self._waiting, []
        try:
            ticket = self.ranks.send([s.data for s in steps])
        except RankCallError as exc:  # a rank is gone or stopped reading
            self._fail(InFlight(steps, None), exc)
        self._inflight.append(InFlight(steps, ticket))
        self.counters.messages += 1

    def _collect_one(self) -> None:
        f = self._inflight.popleft()
        try:
            answers = self.ranks.collect(f.ticket, self.config.step_timeout_s)
        except RankCallError as exc:
            self._fail(f, exc)
        now = time.perf_counter()
        c = self.counters
        for s, outs in zip(f.steps, answers, strict=True):
            latency = now - s.closed_at
            c.latencies_s.append(latency)
            for obs in self.observers:
                obs.step_done(s.step, latency)
            odd, ops_s = odd_ranks(s, outs, self.copies)
            c.rank_ops_s.append(ops_s)
            if odd:
                c.divergences += 1
                self.recovery.fail(
                    DivergenceError(
                        s.step,
                        f"rank(s) {odd} differ from the coordinator's mirror after step {s.step}",
                        tuple(odd),
                    )
                )
            c.steps_done += 1

    def _fail(self, f: InFlight, exc: RankCallError) -> NoReturn:
        cause = exc.cause
        # The step of the message that failed: a lockstep error names it; else the first.
        at = next((s for s in f.steps if s.step == getattr(cause, "step", None)), f.steps[0])
        if isinstance(cause, DivergenceError):
            self.counters.divergences += 1
            odd = odd_by_digest(self.ranks, at.digest)
            self.recovery.fail(
                DivergenceError(at.step, f"{cause.detail}; odd rank(s): {list(odd)}", odd)
            )
        self.counters.rank_failures += 1
        if isinstance(cause, RankFailure):
            self.recovery.fail(RankFailure(at.step, cause.detail), (exc.rank,))
        kind = "died" if exc.dead else "failed"
        self.recovery.fail(
            RankFailure(at.step, f"rank {exc.rank} {kind}: {type(cause).__name__}: {cause}"),
            (exc.rank,),
        )

    def drop(self, why: str, replace: bool = True) -> int:
        """Every running request is lost (``why``: the cause its later calls name; with
        ``replace``, over an earlier one's) and every step not yet checked is dropped.
        Returns how many requests were running."""
        running = self.mirror.running_ids()
        self.lost.lose(running, why, replace=replace)
        self._inflight.clear()
        self._waiting = []
        self._pending = []
        return len(running)

    def start_over(self, capacity: int) -> None:
        """Start the mirror from an empty cache of ``capacity`` tokens (told to the
        observers as step -1's events), steps numbered from 0, a fresh copy log: what
        the ranks restarted with."""
        old = self.mirror
        # A host tier's copy log starts over on the ranks' new caches: so must the mirror's.
        host = old.host
        fresh_log = host is None or (host.copies_completed() == 0 and not host.copies_pending())
        if capacity == old.sizes().capacity and fresh_log:
            old.reset()
        else:
            self.mirror = type(old)(dataclasses.replace(old.config, capacity_tokens=capacity))
            if old.config.record_events:
                old.reset()
                self.mirror.put_back_events(old.take_events())
        events = self.mirror.take_events()
        for obs in self.observers:
            obs.step_sent(-1, events)
        self._next_step = 0
        self.copies.restart()
