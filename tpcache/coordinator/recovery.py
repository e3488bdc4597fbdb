"""Failing and recovering a TP group: what the step pipeline (``steps``) does when a step
fails or diverges, or a health check finds a dead or hung rank.

A failure breaks the group: every running request is lost, the steps not yet checked are
dropped, and the error goes to the caller that hit it. The group is then rebuilt (ranks
replaced, the process group re-formed, every cache started empty), at once, on a thread
of its own (``recover_in_background``), or by hand; a failed attempt is retried with
back-off until one succeeds or the operator stops it.

It reaches the pipeline through ``StepLog`` only, so this module never imports it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import NoReturn, Protocol

from tpcache.coordinator.call_lock import CallLock
from tpcache.coordinator.errors import CoordinatorUnavailable
from tpcache.coordinator.step_types import CoordinatorConfig, Counters, RankCallError, RankTransport
from tpcache.logs import one_line
from tpcache.workers.protocol import DivergenceError, LockstepError, RankFailure

logger = logging.getLogger("tpcache.coordinator")


@dataclass
class Recovery:
    """The state of retried recovery. Owned by ``GroupRecovery``."""

    failures: int = 0  # failed attempts since start
    consecutive: int = 0  # failed attempts since the last success
    next_at: float = 0.0  # time.monotonic() of the next automatic attempt
    last_error: str | None = None
    stopped: bool = False  # the operator stopped automatic attempts

    def backoff(self, config: CoordinatorConfig) -> float:
        """Seconds until the next attempt after ``consecutive`` failures."""
        return min(
            config.recovery_backoff_max_s,
            config.recovery_backoff_s * 2.0 ** max(0, self.consecutive - 1),
        )


class StepLog(Protocol):
    """What recovery needs of the step pipeline (``steps.StepPipeline``)."""

    lock: CallLock
    ranks: RankTransport
    config: CoordinatorConfig
    counters: Counters
    closed: bool  # the coordinator was closed: a rebuild stops

    @property
    def next_step(self) -> int: ...

    @property
    def idle(self) -> bool: ...  # no step pending, waiting or in flight

    def sync(self) -> None: ...

    def drop(self, why: str, replace: bool = True) -> int: ...

    def start_over(self, capacity: int) -> None: ...


class GroupRecovery:
    """Whether the group is broken (``broken``), and bringing it back.

    Every entry point runs with the pipeline's ``lock`` held (the public ones take it);
    a rebuild lets go of it while the ranks restart, and ``recovering`` says so
    meanwhile, so other callers are refused at once (``check_usable``) instead of
    waiting.
    """

    def __init__(self, log: StepLog) -> None:
        self.log = log
        self.broken: LockstepError | None = None  # the failure the group stopped at
        self.state = Recovery()
        # The thread rebuilding the ranks, while one does (set and cleared under the lock).
        self._thread: threading.Thread | None = None

    @property
    def recovering(self) -> bool:
        """Whether the ranks are being rebuilt now (calls are refused meanwhile)."""
        return self._thread is not None

    @property
    def attempts_go_on(self) -> bool:
        """Whether the group is being rebuilt, or an automatic attempt will come."""
        auto = self.log.config.auto_recover and not self.state.stopped
        return self.recovering or (self.broken is not None and auto)

    def fail(self, err: LockstepError, ranks: tuple[int, ...] = ()) -> NoReturn:
        """Stop: every running request is lost (with ``err`` as the cause), then recover
        if configured, and raise ``err`` (retryable) to the caller that hit it. With
        ``recover_in_background`` the recovery runs on a thread of its own and ``err`` is
        raised at once. ``ranks``: the ranks ``err`` names (a divergence's odd ones are
        its own), whose actor and node the log line gives."""
        self.broken = err
        lost = self.log.drop(str(err))
        config = self.log.config
        self._log_failure(err, ranks, lost)
        if config.auto_recover:
            if config.recover_in_background:
                self._in_background()
            elif not self._attempt():
                r = self.state
                err.detail += (
                    f"; recovery failed ({r.last_error}); retrying in {r.backoff(config):g}s"
                )
                err.args = (f"step {err.step}: {err.detail}",)
        raise err

    def _log_failure(self, err: LockstepError, ranks: tuple[int, ...], lost: int) -> None:
        """The operator's line on a failed step or health check."""
        if isinstance(err, DivergenceError):
            ranks = err.odd_ranks
        where = getattr(self.log.ranks, "where", None)
        at = "; ".join(f"rank {r}: {where(r)}" for r in ranks) if where is not None else ""
        auto = self.log.config.auto_recover and not self.state.stopped
        then = "recovering it" if auto else "it stays down until recover() is called"
        tail = f"{f' ({at})' if at else ''}; {lost} running request(s) lost; {then}"
        if isinstance(err, DivergenceError):
            odd = list(err.odd_ranks) if err.odd_ranks else "unknown"
            logger.error(
                "divergence at step %d: odd rank(s) %s: %s%s",
                err.step, odd, one_line(err.detail), tail,
            )  # fmt: skip
        else:
            logger.warning(
                "the TP group failed at step %d: %s%s", err.step, one_line(err.detail), tail
            )

    def _attempt(self) -> bool:
        """One recovery attempt (lock held); on failure the next is due after the back-off."""
        r = self.state
        started = time.monotonic()
        try:
            self._rebuild()
        except Exception as exc:  # a rank that died or hung while the group re-formed
            r.failures += 1
            r.consecutive += 1
            r.last_error = f"{type(exc).__name__}: {exc}"
            wait = r.backoff(self.log.config)
            r.next_at = time.monotonic() + wait
            logger.warning(
                "recovery attempt %d failed after %.1f s: %s; %s",
                r.consecutive, time.monotonic() - started, one_line(r.last_error),
                "no more attempts (closed)" if self.log.closed
                else f"next attempt in {wait:g} s",
            )  # fmt: skip
            return False
        return True

    def _in_background(self) -> None:
        """Start one recovery attempt on a thread of its own (lock held), unless one runs
        already."""
        if self._thread is not None:
            return

        def attempt() -> None:
            with self.log.lock:
                try:
                    self._attempt()
                finally:  # whatever happened, the next attempt may start
                    self._thread = None

        self._thread = threading.Thread(target=attempt, name="tpcache-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop automatic recovery attempts (a broken group stays down until ``recover()``
        is called by hand; an attempt already running finishes). Changes no cache state."""
        with self.log.lock:
            self.state.stopped = True
        logger.info("automatic recovery stopped: a broken group stays down until recover()")

    def recover(self) -> None:
        """Replace dead or hung ranks, rebuild the process group, and start every rank and
        the mirror from an empty cache (announced once as ``AllBlocksCleared``).

        Requests that were running are lost: later calls for them raise ``RequestLost``.
        Raises what the ranks' restart raised (the group stays broken, and an automatic
        attempt follows after the back-off unless stopped), or ``CoordinatorUnavailable``
        if a recovery runs already. Called by hand it also restarts automatic attempts
        that ``stop`` stopped.
        """
        with self.log.lock:
            if self._thread is not None:
                raise CoordinatorUnavailable("the TP group is being recovered already")
            self._rebuild()

    def _rebuild(self) -> None:
        """``recover``'s work, with the lock held. The lock is let go while the ranks
        restart (seconds: new processes, the group's join), so other callers are refused
        at once (``check_usable``) instead of waiting; nothing else touches the mirror
        or the ranks meanwhile."""
        log = self.log
        started = time.monotonic()
        self.state.stopped = False
        lost = log.drop("the coordinator recovered its TP group", replace=False)
        _log_start(self.broken, lost)
        self._thread = threading.current_thread()
        try:
            with log.lock.released():
                capacity = log.ranks.restart(log.config.probe_s)
        except Exception:
            if not log.closed:
                raise
        finally:
            self._thread = None
        if log.closed:  # closed while the ranks restarted: stop what the restart started
            log.ranks.close()
            raise CoordinatorUnavailable("the coordinator was closed during a recovery")
        log.start_over(capacity)
        self.broken = None
        self.state.consecutive = 0
        self.state.last_error = None
        log.counters.recoveries += 1
        log.counters.last_recovery_s = took = time.monotonic() - started
        replaced = getattr(log.ranks, "last_replaced", None)
        _log_done(took, replaced, capacity)

    def check_health(self) -> bool:
        """Ping every rank (bounded by ``probe_s``); on a dead or hung rank, fail and
        recover as a failed step would. Returns True if all were healthy."""
        log = self.log
        with log.lock:
            self.check_usable()
            if not log.idle:
                log.sync()  # a failure shows up here, and recovers
                return True
            try:
                log.ranks.call("ping", timeout=log.config.probe_s)
            except RankCallError as exc:
                log.counters.rank_failures += 1
                kind = "died" if exc.dead else "did not answer a health check"
                self.fail(
                    RankFailure(log.next_step, f"rank {exc.rank} {kind}: {exc.cause}"), (exc.rank,)
                )
            return True

    def check_usable(self) -> None:
        """Raise ``CoordinatorUnavailable`` (retryable) while the ranks are being rebuilt
        or the group is broken. Where an automatic recovery attempt is due, make it first
        (or, with ``recover_in_background``, start it): so a served coordinator (its
        health check) or any caller that retries brings a broken group back."""
        if self._thread is not None:
            what = f"stopped at {self.broken}" if self.broken is not None else "is restarting"
            raise CoordinatorUnavailable(
                f"the TP group {what}; it is being recovered now, retry shortly"
            )
        if self.broken is None:
            return
        r = self.state
        config = self.log.config
        auto = config.auto_recover and not r.stopped
        if auto and time.monotonic() >= r.next_at:
            if config.recover_in_background:
                self._in_background()
                raise CoordinatorUnavailable(
                    f"the TP group stopped at {self.broken}; it is being recovered now, "
                    "retry shortly"
                )
            if self._attempt():
                return
        if not auto:
            why = "it must be recovered by hand (recover())"
        else:
            wait = max(0.0, r.next_at - time.monotonic())
            why = f"recovery attempt {r.consecutive} failed ({r.last_error}); next in {wait:.1f}s"
        raise CoordinatorUnavailable(f"the TP group stopped at {self.broken}; {why}")


def _log_start(broken: LockstepError | None, lost: int) -> None:
    why = f"after step {broken.step}" if broken is not None else "asked by hand"
    # After a failure, its own line told the requests lost; by hand, this one does.
    extra = f"; {lost} running request(s) lost" if lost and broken is None else ""
    logger.info(
        "recovering the TP group (%s): replacing dead or hung ranks, every cache starts "
        "empty%s", why, extra,
    )  # fmt: skip


def _log_done(took: float, replaced: list[int] | None, capacity: int) -> None:
    which = "not known" if replaced is None else (str(replaced) if replaced else "none")
    logger.info(
        "the TP group recovered in %.1f s: rank(s) replaced: %s; capacity %d tokens",
        took, which, capacity,
    )  # fmt: skip
