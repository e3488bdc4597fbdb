"""Serving the msgspec frontend API on a ``Coordinator``: decode, dispatch, reply.

Nothing a caller sends can crash the coordinator: a malformed message or a rejected call
becomes an ``ErrorReply`` naming the error type; the state is unchanged.
"""

from __future__ import annotations

from tpcache.cache.errors import CacheError
from tpcache.coordinator.api import (
    AbortCall,
    AdmitCall,
    AdmitReply,
    CachedReply,
    CacheUnfinishedCall,
    Call,
    CoordinatorUnavailable,
    ErrorReply,
    ExtendCall,
    FinishCall,
    OkReply,
    Reply,
    RequestLost,
    SlotsReply,
    StatsCall,
    StatsReply,
    decode_call,
    encode,
)
from tpcache.coordinator.core import Coordinator
from tpcache.workers.lockstep import LockstepError

_REJECTED = (CacheError, CoordinatorUnavailable, RequestLost, LockstepError)


def dispatch(coord: Coordinator, call: Call) -> Reply:
    """Run one call; typed errors become an ``ErrorReply``."""
    try:
        match call:
            case AdmitCall(rid, tokens, priority, reserve):
                got = coord.admit(rid, tokens, priority, reserve)
                return AdmitReply(got.prefix_len, got.slots.tolist())
            case ExtendCall(rid, n):
                return SlotsReply(coord.extend(rid, n).tolist())
            case CacheUnfinishedCall(rid, tokens):
                return CachedReply(coord.cache_unfinished(rid, tokens))
            case FinishCall(rid, output):
                return CachedReply(coord.finish(rid, output))
            case AbortCall(rid):
                coord.abort(rid)
                return OkReply()
            case StatsCall():
                return StatsReply(coord.stats())
    except _REJECTED as exc:
        return ErrorReply(type(exc).__name__, str(exc), bool(getattr(exc, "retryable", False)))
    except Exception as exc:  # a bug: the frontend still gets a reply, and the type's name
        return ErrorReply(type(exc).__name__, f"internal error: {exc}")
    return ErrorReply("BadRequest", f"unknown call {call!r}")


def handle(coord: Coordinator, data: object) -> bytes:
    """One encoded call in, one encoded reply out (its ops form one step). Anything that
    is not a valid call (not bytes, malformed) gets an ``ErrorReply``."""
    try:
        call = decode_call(data)
    except CacheError as exc:
        return encode(ErrorReply(type(exc).__name__, str(exc)))
    return encode(dispatch(coord, call))


def handle_many(coord: Coordinator, items: object) -> list[bytes]:
    """Several encoded calls applied in order as one step; one reply each.

    Every item is decoded before any is applied: one that is not a valid call refuses
    the whole batch (every reply a ``BadRequest`` naming it), and nothing changes.
    A call the cache refuses gets its own ``ErrorReply``; the others apply."""
    if not isinstance(items, list | tuple):
        why = f"a batch must be a list of encoded calls, got {type(items).__name__}"
        return [encode(ErrorReply("BadRequest", why))]
    calls: list[Call] = []
    for i, data in enumerate(items):
        try:
            calls.append(decode_call(data))
        except CacheError as exc:
            err = encode(ErrorReply("BadRequest", f"call {i} of the batch: {exc}; none applied"))
            return [err] * len(items)
    replies: list[bytes] = []
    try:
        with coord.batch():
            for call in calls:
                replies.append(encode(dispatch(coord, call)))
    except _REJECTED as exc:
        # The step itself failed to send or check: every call of it is lost.
        err = encode(ErrorReply(type(exc).__name__, str(exc), True))
        replies = [err] * len(items)
    return replies
