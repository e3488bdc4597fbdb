"""The lockstep protocol: how one rank applies one step, and every collective it enters.

Who decides: the coordinator (under Ray) or rank 0 (under torchrun) builds each step's
op batch from its own mirror of the cache; the batch is the same bytes on every rank.
What is broadcast: under torchrun, the step's length then its bytes (``broadcast_step``);
under Ray, the coordinator sends the same bytes to each rank's actor.
What is agreed by MIN, in this order, by every rank, always:
  1. for each op that may evict (``Evict``, or ``Admit``/``Extend`` whose mirror
     evicted), one ``all_min([evictable pages])``: a rank evicts
     ``min(asked, MIN evictable)``; a rank that already failed sends -1;
  2. after the whole batch, one ``min_max([status, digest])``: status -1 from any rank
     makes every rank raise ``RankFailure``; MIN != MAX of the digest makes every rank
     raise ``DivergenceError``.
Which collectives run depends only on the batch, never on local state, so a rank that
has gone wrong still enters exactly the same collectives as its peers and nobody hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from tpcache.workers.group import i64_to_u64, u64_to_i64
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
    StepResult,
    decode_step,
    encode,
    unpack_tokens,
)


class Agreement(Protocol):
    """The two collectives a step needs (``TPGroup`` provides them)."""

    def all_min(self, values: list[int]) -> list[int]: ...

    def min_max(self, values: list[int]) -> tuple[list[int], list[int]]: ...

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes: ...


class LockstepError(RuntimeError):
    """The group can no longer go on in lockstep; the coordinator must recover."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"step {step}: {message}")
        self.step = step
        self.detail = message

    def __reduce__(self):
        return (type(self), (self.step, self.detail))


class DivergenceError(LockstepError):
    """Ranks hold different cache states after ``step``.

    ``odd_ranks`` is filled in by whoever gathered every rank's digest (the coordinator).
    """

    def __init__(self, step: int, message: str, odd_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(step, message)
        self.odd_ranks = odd_ranks

    def __reduce__(self):
        return (type(self), (self.step, self.detail, self.odd_ranks))


class RankFailure(LockstepError):
    """An op failed on at least one rank during ``step``."""


def op_may_evict(op: Op) -> bool:
    """Whether ``op`` enters the evictable-size agreement (decided by the batch alone)."""
    if isinstance(op, Evict):
        return True
    return isinstance(op, Admit | Extend) and op.evict_pages > 0


def apply_op(cache, op: Op, evict_fn: Callable[[int], int]) -> OpResult:
    """Apply one op to ``cache`` (a ``RadixCache`` or hybrid cache); the result to compare.

    ``evict_fn(pages)`` evicts up to ``pages`` pages under agreement and returns how many
    it evicted. The mirror passes a local eviction, ranks an agreed one.
    """
    match op:
        case Admit(rid, tokens, priority, evict_pages):
            evicted = [0]

            def evictor(_short: int) -> None:
                if evict_pages:
                    evicted[0] = evict_fn(evict_pages)

            got = cache.admit(rid, unpack_tokens(tokens), priority, evict=evictor)
            slots = got.slots
            return OpResult(got.prefix_len, int(slots.size), int(slots.sum()), evicted[0])
        case Extend(rid, n, evict_pages):
            evicted = [0]

            def evictor(_short: int) -> None:
                if evict_pages:
                    evicted[0] = evict_fn(evict_pages)

            slots = cache.extend(rid, n, evict=evictor)
            return OpResult(0, int(slots.size), int(slots.sum()), evicted[0])
        case CacheUnfinished(rid, tokens):
            n = cache.cache_unfinished(rid, unpack_tokens(tokens))
            return OpResult(prefix_len=n)
        case Finish(rid, output):
            n = cache.finish(rid, unpack_tokens(output))
            return OpResult(prefix_len=n)
        case Abort(rid):
            cache.abort(rid)
            return OpResult()
        case Evict(num_tokens):
            pages = -(-num_tokens // cache.page_size)
            return OpResult(evicted_pages=evict_fn(pages))
        case Reset():
            cache.reset()
            return OpResult()
    raise TypeError(f"unknown op {op!r}")


def evictable_pages(cache) -> int:
    return cache.sizes().evictable // cache.page_size


def apply_step(
    cache,
    group: Agreement,
    rank: int,
    step: Step,
    tamper: Callable[[Op], Op] | None = None,
) -> StepResult:
    """Apply ``step`` on this rank in lockstep with its peers (see the module docstring).

    ``tamper`` (tests and fault drills only) may replace an op before it is applied.
    Raises ``RankFailure`` or ``DivergenceError`` on every rank together.
    """
    started = time.perf_counter()
    results: list[OpResult] = []
    failure: str | None = None
    for op in step.ops:
        entered = [False]

        def agreed_evict(pages: int, _entered: list[bool] = entered) -> int:
            _entered[0] = True  # only called while this rank is healthy
            agreed = group.all_min([evictable_pages(cache)])[0]
            if agreed < 0:
                raise RankFailure(step.step, "a peer failed earlier in this step")
            return cache.tree.evict(min(pages, agreed))[0]

        if failure is None:
            try:
                results.append(apply_op(cache, tamper(op) if tamper else op, agreed_evict))
            except Exception as exc:  # any local failure must reach the peers, not hang them
                failure = f"{type(exc).__name__}: {exc}"
                results.append(OpResult())
        else:
            results.append(OpResult())
        if op_may_evict(op) and not entered[0]:
            # This rank skipped the op's agreement (failed, or the op failed early):
            # enter it anyway with the failure sentinel so the peers don't wait.
            group.all_min([-1])
            failure = failure or f"op {type(op).__name__} did not reach its agreement"
    digest = cache.digest()
    mins, maxs = group.min_max([0 if failure is None else -1, u64_to_i64(digest)])
    if mins[0] < 0:
        where = f"this rank ({rank}): {failure}" if failure else "another rank"
        raise RankFailure(step.step, f"an op failed on {where}")
    if mins[1] != maxs[1]:
        raise DivergenceError(
            step.step,
            f"cache digests differ across ranks (this rank {digest:#018x}, "
            f"min {i64_to_u64(mins[1]):#018x}, max {i64_to_u64(maxs[1]):#018x})",
        )
    return StepResult(step.step, rank, digest, results, (time.perf_counter() - started) * 1e6)


def broadcast_step(group: Agreement, data: bytes | None, src: int = 0) -> Step:
    """torchrun transport: ``src`` sends the encoded step (length, then bytes); all decode."""
    return decode_step(group.broadcast_bytes(data, src))


__all__ = [
    "DivergenceError",
    "LockstepError",
    "RankFailure",
    "apply_op",
    "apply_step",
    "broadcast_step",
    "encode",
]
