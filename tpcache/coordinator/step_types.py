"""What the step pipeline (``steps``) is made of: how it reaches the ranks (``RankTransport``)
and who hears of its steps (``StepObserver``), its configuration, and its records.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tpcache.coordinator.errors import CoordinatorConfigError
from tpcache.errors import TpcacheError
from tpcache.group.spec import GroupInputError, check_seconds
from tpcache.lockstep.ops import OpResult

MAX_SECONDS = 1e9  # the longest wait a config may ask for (~31 years: "no limit")


class RankCallError(TpcacheError):
    """A rank's call failed: ``rank`` names it, ``cause`` is what it raised (or why it died)."""

    def __init__(self, rank: int, cause: BaseException, dead: bool = False) -> None:
        super().__init__(f"rank {rank}: {type(cause).__name__}: {cause}")
        self.rank = rank
        self.cause = cause
        self.dead = dead


def first_cause(failures: list[RankCallError]) -> RankCallError:
    """Of the ranks' failed calls (in arrival order), the one to report: a rank where a
    step failed locally (``RankFailure.local``) before the peers that only heard of it
    through an agreement; else the first to arrive."""
    for f in failures:
        if getattr(f.cause, "local", False):
            return f
    return failures[0]


class StepObserver(Protocol):
    """Told of every step: its KV events when it is sent, its latency when verified."""

    def step_sent(self, step: int, events: list) -> None: ...

    def step_done(self, step: int, latency_s: float) -> None: ...


class RankTransport(Protocol):
    """How the coordinator reaches its ranks (Ray actors, or anything with these calls)."""

    world_size: int
    # Whether the ranks check each step's digest with each other (``Step.peer_check``, a
    # collective per step). False only where ``collect`` returns every rank's result (the
    # coordinator compares each with its mirror) and itself fails a rank that lags its
    # peers by more than the collective timeout (a hung rank, which the check's timeout
    # would have caught). torchrun returns rank 0's result only: there it must be True.
    peer_check: bool

    def send(self, steps: list[bytes]) -> Any: ...  # one message: encoded steps, in order

    def ready(self, ticket: Any) -> bool: ...

    # Per step of the message, the encoded results of the ranks that answer.
    def collect(self, ticket: Any, timeout: float) -> list[list[bytes]]: ...

    def call(self, method: str, *args: Any) -> list[Any]: ...

    def paths(self) -> list[str]: ...  # how each rank is reached, e.g. "ipc", "tcp+curve"

    def close(self) -> None: ...


@dataclass(frozen=True)
class CoordinatorConfig:
    max_inflight: int = 4  # messages sent and not yet verified
    max_batch_ops: int = 1024
    # Per message: how long the coordinator waits for its results. ``step_timeout_for``
    # derives it from the ranks' collective timeout (120 s for 60 s; the CLI does so).
    step_timeout_s: float = 120.0
    auto_recover: bool = True  # after a rank failure or divergence, rebuild the group at once
    probe_s: float = 2.0  # a rank that does not answer a ping this fast is replaced
    # Most steps one message carries (1: one step per message). 32, not 8: with 8 the
    # caller blocked while the ranks still worked (scripts/bench_lockstep.py measures it).
    coalesce: int = 32
    # After a failed recovery (a rank died while the group was being rebuilt), the next
    # attempt waits this long, doubling per failure up to the max, until one succeeds or
    # the operator stops it (``stop_recovery``).
    recovery_backoff_s: float = 1.0
    recovery_backoff_max_s: float = 30.0
    # Rebuild the group on a thread of its own after a failure, so the caller that hit it
    # gets its error at once too (a served coordinator: its callers are other programs).
    # False: that caller waits for the recovery, and its next call finds the group back.
    # Either way, other callers are refused with CoordinatorUnavailable meanwhile.
    recover_in_background: bool = False

    def __post_init__(self) -> None:
        for name in ("max_inflight", "max_batch_ops", "coalesce"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CoordinatorConfigError(
                    f"coordinator config: {name} must be an int >= 1, got {v!r}"
                )
        for name in ("auto_recover", "recover_in_background"):
            if not isinstance(getattr(self, name), bool):
                raise CoordinatorConfigError(
                    f"coordinator config: {name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("step_timeout_s", "probe_s", "recovery_backoff_s", "recovery_backoff_max_s"):
            v = getattr(self, name)
            # (a NaN fails the comparison too)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < MAX_SECONDS:
                raise CoordinatorConfigError(
                    f"coordinator config: {name} must be seconds in (0, {MAX_SECONDS:g}), got {v!r}"
                )


# What a step may take beyond its collectives' timeout, however short that is: a rank's
# error after its collective timed out must still travel back (pickled, sent, and the
# channel's 1 s grace for its peers' errors), on a host that may be busy.
STEP_SLACK_S = 5.0


def step_timeout_for(timeout_s: float, name: str = "timeout_s") -> float:
    """The coordinator's wait for a message's results (``step_timeout_s``) in a group whose
    collectives time out after ``timeout_s``: ``max(2 * timeout_s, timeout_s +
    STEP_SLACK_S)``, so 60 s gives 120 s (the default) and 2 s gives 7 s. Raises
    ``CoordinatorConfigError`` (naming ``timeout_s`` as ``name``) unless it is a finite
    number of seconds > 0 whose step timeout is under ``MAX_SECONDS``.

    Why more than ``timeout_s``. Where a rank has peers, its hang is found by them: a
    peer's collective times out, or the step channel sees it lag a peer's answer by
    ``timeout_s``; either names the step and the hung rank, so the coordinator's own
    (bare) timeout must not fire first. And a healthy step may run longer than one
    collective's timeout: a rank that evicts much may make its peers wait up to nearly
    ``timeout_s`` in the next agreement (they accept that), and the step still has its
    other ops, its digest and its way back to do; failing it would lose every running
    request and replace a rank that was only slow. Twice the timeout leaves a whole
    ``timeout_s`` for that; ``STEP_SLACK_S`` covers what does not shrink with a short
    timeout. Where no peer can notice (TP=1, or every rank hung), this is how long a
    hung rank goes unseen. It bounds a whole message, as ``step_timeout_s`` does: steps
    coalesced into one message share it.
    """
    try:
        check_seconds(name, timeout_s)
    except GroupInputError as exc:
        raise CoordinatorConfigError(str(exc)) from None
    step = max(2.0 * timeout_s, timeout_s + STEP_SLACK_S)
    if step >= MAX_SECONDS:
        raise CoordinatorConfigError(
            f"{name}={timeout_s!r} is too long: the coordinator would wait {step:g} s for "
            f"a step, and waits are limited to under {MAX_SECONDS:g} s"
        )
    return step


@dataclass
class Closed:
    """A step closed by the coordinator: what every rank must answer for it."""

    step: int
    data: bytes
    digest: int  # the mirror's after this step; set at the send (see StepPipeline._send)
    expected: list[OpResult]
    closed_at: float


@dataclass
class InFlight:
    """One message: its steps, in order, and the transport's ticket for the answers."""

    steps: list[Closed]
    ticket: Any


@dataclass
class Counters:
    """Owned by the coordinator; read by ``stats()`` and the metrics exporter."""

    steps_done: int = 0
    messages: int = 0  # sent to the ranks: fewer than steps when steps were coalesced
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
