"""The lockstep protocol: how one rank applies one step, and every collective it enters.

Who decides: the coordinator (under Ray) or rank 0 (under torchrun) builds each step's
op batch from its own mirror of the cache; the batch is the same bytes on every rank.
What is broadcast: under torchrun, the step's length then its bytes (``broadcast_step``);
under Ray, the coordinator sends the same bytes to each rank's actor.
What is agreed by MIN, in this order, by every rank, always:
  1. for each op that may evict (``Evict``, or ``Admit``/``Extend`` whose mirror
     evicted), one ``agree_min(cache.evictable_pages())`` (one entry per pool: full, and
     SWA for a hybrid cache): a rank evicts ``min(asked, MIN evictable)`` per pool, where
     "asked" is what the mirror's eviction was asked for (the op carries the decision,
     never the counts it freed: a hybrid SWA-only ask frees full pages too, and replaying
     those counts would run the full order and delete other nodes); a rank that already
     failed sends -1;
  2. for each ``CopySync`` op (in a step closed while the host tier's copies are
     pending), one ``agree_min([done copies])`` (``copysync.py``; -1 fails the step on
     every rank);
  3. after the whole batch, if the step says so (``Step.peer_check``), one
     ``digest_check(digest)`` (``None`` from a rank that failed): a failure anywhere
     makes every rank raise ``RankFailure``; digests that differ make every rank raise
     ``DivergenceError`` (NCCL compares all 64 bits by MIN and MAX; gloo a 31-bit fold in
     one element; the coordinator compares each rank's whole digest with its mirror's
     either way). The step channel turns it off: there the coordinator gets every
     rank's digest, names the odd rank itself, and fails a rank that lags its peers, so
     a step that evicts nothing makes no collective at all (the check cost a one-element
     all-reduce per step, 0.3-0.5 ms at TP=2 on CPU). A rank that failed raises
     ``RankFailure`` alone then, and enters every later step's agreements with the
     failure sentinel (``fail_step``), since its peers may go on.
A forward (``model_host.py``) adds one ``agree_min`` on its verdict before the runner
starts, except on the step channel, where the coordinator collects each rank's verdict
(``prepare_forward``) and sends ``run_forward`` once all accepted.
Both carry as few elements as they can: under gloo a collective's cost grows with them
(``tpcache.group.tp_group``).
Which collectives run depends only on the batch, never on local state, so a rank that
has gone wrong still enters exactly the same collectives as its peers and nobody hangs.

Under torchrun rank 0 drives the others with ``Command``s: ``lead.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from tpcache.cache.errors import CacheError
from tpcache.errors import TpcacheError
from tpcache.group.spec import i64_to_u64, u64_to_i64
from tpcache.lockstep.errors import DivergenceError, LockstepError, RankFailure, UnknownOp
from tpcache.lockstep.oplog import admit_result, evict_result, extend_result, op_namespace
from tpcache.lockstep.ops import (
    Abort,
    Admit,
    CacheUnfinished,
    CopiesDone,
    CopySync,
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
from tpcache.workers.copysync import RankCopies, sync_copies


class Agreement(Protocol):
    """The two collectives a step needs (``TPGroup`` provides them)."""

    def agree_min(self, values: list[int]) -> list[int]: ...

    def digest_check(self, digest: int | None) -> tuple[int, int] | None: ...

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes: ...


class _PeerFailed(TpcacheError):
    """Raised inside a step when an agreement carries a peer's failure sentinel."""


# ---- a rank's side --------------------------------------------------------------------------
def op_may_evict(op: Op) -> bool:
    """Whether ``op`` enters the evictable-size agreement (decided by the batch alone)."""
    if isinstance(op, Admit | Extend):
        return op.evict_pages > 0 or op.evict_swa_pages > 0
    return isinstance(op, Evict)


class _OpEvictor:
    """The ``evict`` callback of one Admit/Extend whose op asks for an eviction: evicts
    what the op log asks (not the local shortfall it is called with) and remembers the
    pages freed per pool."""

    def __init__(self, op: Admit | Extend, evict_fn: EvictFn) -> None:
        self.asks = (op.evict_pages, op.evict_swa_pages)
        self.evict_fn = evict_fn
        self.evicted: tuple[int, ...] = (0,)

    def __call__(self, *_short: int) -> None:
        self.evicted = self.evict_fn(self.asks)


class _NoEvictor:
    """The ``evict`` callback of an Admit/Extend that asks for nothing: evicts nothing
    (the same for every op, so one object serves them all)."""

    evicted: tuple[int, ...] = (0,)

    def __call__(self, *_short: int) -> None:
        return None


_NO_EVICTOR = _NoEvictor()


def _evictor(op: Admit | Extend, evict_fn: EvictFn) -> _OpEvictor | _NoEvictor:
    if op.evict_pages or op.evict_swa_pages:
        return _OpEvictor(op, evict_fn)
    return _NO_EVICTOR


EvictFn = Callable[[tuple[int, ...]], tuple[int, ...]]


def local_evict(cache) -> EvictFn:
    """The ``evict_fn`` of a lone replica (no peers to agree with): evicts what is asked."""
    return cache.evict_pages


def apply_op(cache, op: Op, evict_fn: EvictFn) -> OpResult:
    """Apply one op to ``cache`` (a ``RadixCache`` or hybrid cache); the result to compare.

    ``evict_fn(asks)`` evicts as asked, per pool (full, then SWA for a hybrid cache),
    under agreement, and returns the pages freed per pool. The mirror applies calls
    directly (``logged_admit``), ranks through this with an agreed eviction.
    """
    # Class patterns read the fields as attributes: a positional capture costs a lookup
    # through __match_args__, half a microsecond per op on every rank.
    match op:
        case Admit():
            evictor = _evictor(op, evict_fn)
            got = cache.admit(
                op.rid,
                unpack_tokens(op.tokens),
                op.priority,
                evict=evictor,
                reserve=op.reserve,
                namespace=op_namespace(op.namespace),
            )
            return admit_result(got, evictor.evicted)
        case Finish():
            return OpResult(prefix_len=cache.finish(op.rid, unpack_tokens(op.output)))
        case Extend():
            evictor = _evictor(op, evict_fn)
            slots = cache.extend(op.rid, op.n, evict=evictor)
            return extend_result(slots, evictor.evicted)
        case CacheUnfinished():
            n = cache.cache_unfinished(op.rid, unpack_tokens(op.tokens))
            return OpResult(prefix_len=n)
        case Abort():
            cache.abort(op.rid)
            return OpResult()
        case Evict():
            ps = cache.page_size
            asks = (-(-op.num_tokens // ps), -(-op.swa_tokens // ps))
            return evict_result(evict_fn(asks))
        case Reset():
            cache.reset()
            return OpResult()
        case CopiesDone():
            if cache.host is not None:
                cache.host.copies_done(op.n)
            elif op.n:
                raise CacheError(f"this cache starts no copies: {op.n!r} cannot be done")
            return OpResult()
    raise UnknownOp(f"unknown op {op!r}")


class _AgreedEvict:
    """The ``evict_fn`` of a rank's ops in one step: each eviction agrees the evictable
    pages by MIN first (a peer's -1 raises ``_PeerFailed``). ``entered``: whether the op
    in hand entered its agreement (``apply_step`` resets it per op)."""

    def __init__(self, cache, group: Agreement) -> None:
        self.cache = cache
        self.group = group
        self.entered = False

    def __call__(self, asks: tuple[int, ...]) -> tuple[int, ...]:
        self.entered = True  # only called while this rank is healthy
        agreed = self.group.agree_min(list(self.cache.evictable_pages()))
        if min(agreed) < 0:
            raise _PeerFailed
        return self.cache.evict_pages(tuple(map(min, asks, agreed)))


def apply_step(
    cache,
    group: Agreement,
    rank: int,
    step: Step,
    tamper: Callable[[Op], Op] | None = None,
    copies: RankCopies | None = None,
) -> StepResult:
    """Apply ``step`` on this rank in lockstep with its peers (see the module docstring).

    ``tamper`` (tests and fault drills only) may replace an op before it is applied.
    ``copies``: this rank's host tier, which runs the copies each op starts.
    Raises ``RankFailure`` or ``DivergenceError`` on every rank together.
    """
    # One function on purpose (60 lines): which collectives a step enters, in which order
    # and with which sentinel, is the protocol; it reads top to bottom here, in one loop.
    started = time.perf_counter()
    results: list[OpResult] = []
    failure: str | None = None  # this rank's own failure
    peer_failed_at: int | None = None  # the op whose agreement carried a peer's failure
    agreed_copies = -1
    agreed_evict = _AgreedEvict(cache, group)
    for i, op in enumerate(step.ops):
        if isinstance(op, CopySync):  # one collective, entered by every rank
            healthy = failure is None and peer_failed_at is None
            agreed_copies = sync_copies(group, copies, healthy, op)
            results.append(OpResult())
            if agreed_copies < 0 and healthy:
                if copies is not None and copies.local_done() < 0:
                    failure = f"op {i} (CopySync): a host copy failed here"
                else:  # a peer failed: it names itself (``RankFailure.local``)
                    peer_failed_at = i
            continue
        agreed_evict.entered = False
        if failure is None and peer_failed_at is None:
            try:
                results.append(apply_op(cache, tamper(op) if tamper else op, agreed_evict))
                if copies is not None:
                    copies.submit(cache.host.take_copies())
            except _PeerFailed:  # stop here: a peer failed before this agreement
                peer_failed_at = i
                results.append(OpResult())
            except Exception as exc:  # any local failure must reach the peers, not hang them
                failure = f"op {i} ({type(op).__name__}): {type(exc).__name__}: {exc}"
                results.append(OpResult())
        else:
            results.append(OpResult())
        if not agreed_evict.entered and op_may_evict(op):
            # This rank skipped the op's agreement (failed, or the op failed early):
            # enter it anyway with the failure sentinel so the peers don't wait.
            group.agree_min([-1] * len(cache.evictable_pages()))
            if failure is None and peer_failed_at is None:
                failure = f"op {i} ({type(op).__name__}) did not reach its agreement"
    digest = cache.digest()
    ops_us = (time.perf_counter() - started) * 1e6
    if step.peer_check:
        agree_digest(group, step.step, rank, digest, failure, peer_failed_at)
    elif failure is not None or peer_failed_at is not None:
        raise _step_failure(step.step, rank, failure, peer_failed_at)
    apply_us = (time.perf_counter() - started) * 1e6
    return StepResult(step.step, rank, digest, results, apply_us, ops_us, agreed_copies)


def agree_digest(
    group: Agreement,
    step: int,
    rank: int,
    digest: int,
    failure: str | None,
    peer_failed_at: int | None,
) -> None:
    """The step's last collective: ``digest_check`` of this rank's ``digest`` (``None``
    if this rank failed, at ``failure``, or saw a peer's failure at op
    ``peer_failed_at``). Raises ``RankFailure`` if any rank failed, ``DivergenceError``
    if the digests differ, on every rank together."""
    healthy = failure is None and peer_failed_at is None
    span = group.digest_check(u64_to_i64(digest) if healthy else None)
    if span is None:
        raise _step_failure(step, rank, failure, peer_failed_at)
    if span[0] != span[1]:
        raise DivergenceError(
            step,
            f"cache digests differ across ranks (this rank {digest:#018x}; over the ranks "
            f"{i64_to_u64(span[0]):#x} and {i64_to_u64(span[1]):#x}: the MIN and MAX of "
            "the digests under NCCL, the AND and OR of their 31-bit folds under gloo)",
        )


def _step_failure(
    step: int, rank: int, failure: str | None, peer_failed_at: int | None
) -> RankFailure:
    if failure is not None:
        return RankFailure(step, f"rank {rank} failed at {failure}", local=True)
    seen = f" (announced at op {peer_failed_at}'s agreement)" if peer_failed_at is not None else ""
    return RankFailure(step, f"an op failed on another rank{seen}")


def fail_step(cache, group: Agreement, rank: int, step: Step, why: str) -> RankFailure:
    """A rank that cannot apply ``step`` (it failed at an earlier one, or the step is out
    of order) still enters the step's collectives, each with the failure sentinel, so
    that its peers stop at the step's first agreement instead of waiting; returns the
    ``RankFailure`` to raise. Without a per-step check among peers (``peer_check``
    False) a peer may have gone on after this rank failed: this keeps it from hanging."""
    pools = len(cache.evictable_pages())
    for op in step.ops:
        if op_may_evict(op):
            group.agree_min([-1] * pools)
        elif isinstance(op, CopySync):
            group.agree_min([-1])
    if step.peer_check:
        group.digest_check(None)
    return RankFailure(step.step, f"rank {rank} failed: {why}", local=True)


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
    "evict_result",
    "fail_step",
    "local_evict",
]
