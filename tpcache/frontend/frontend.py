"""Serving the msgspec frontend API on a ``Coordinator``: decode, dispatch, reply.

Nothing a caller sends can crash the coordinator: a malformed message or a rejected call
becomes an ``ErrorReply`` naming the error type; the state is unchanged.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from tpcache.cache.errors import CacheError
from tpcache.cache.keys import pages_to_slots
from tpcache.cache.namespace import make_namespace
from tpcache.coordinator.copy_agree import CopiesNotDone
from tpcache.coordinator.core import Coordinator
from tpcache.frontend.api import (
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
    error_reply,
    max_call_bytes,
)
from tpcache.frontend.netfront import FrontendConfig, NetFrontend
from tpcache.workers.lockstep import LockstepError

# What a call answers as a typed error (the Ray service's own calls too), not as a crash.
REJECTED = (CacheError, CoordinatorUnavailable, RequestLost, LockstepError, CopiesNotDone)


def _wait_ready(coord: Coordinator, rid) -> None:
    """A frontend's engine runs its forward as soon as it has the slots, so with a host
    tier an admit or extend whose prefix is being loaded replies only once that load is
    done on every rank (a write-back still reading pages it got needs no wait here: each
    rank's forward waits for its own copies). If it is not within the step timeout (a
    rank's copies are stuck), the request is aborted and the reply is ``CopiesNotDone``.
    A request with no pending load replies at once."""
    if coord.mirror.request_ready(rid):
        return
    try:
        coord.wait_ready([rid], coord.config.step_timeout_s)
    except CopiesNotDone as exc:
        coord.abort(rid)
        raise CopiesNotDone(f"request {rid!r} aborted: {exc}") from None


def dispatch(coord: Coordinator, call: Call) -> Reply:
    """Run one call; typed errors become an ``ErrorReply``."""
    try:
        match call:
            case AdmitCall(rid, tokens, priority, reserve):
                space = make_namespace(call.lora_id, call.lora_name, call.cache_salt)
                got = coord.admit(rid, tokens, priority, reserve, space)
                _wait_ready(coord, rid)
                return AdmitReply(
                    got.prefix_len, got.slots.tolist(), *_swa(coord, rid, got.prefix_len)
                )
            case ExtendCall(rid, n):
                slots = coord.extend(rid, n)
                _wait_ready(coord, rid)
                start = coord.mirror.request_row(rid).num_tokens - slots.size
                return SlotsReply(slots.tolist(), *_swa(coord, rid, start))
            case CacheUnfinishedCall(rid, tokens):
                return _cache_unfinished(coord, rid, tokens)
            case FinishCall(rid, output):
                return CachedReply(coord.finish(rid, output))
            case AbortCall(rid):
                coord.abort(rid)
                return OkReply()
            case StatsCall():
                return StatsReply(coord.stats())
    except REJECTED as exc:
        return error_reply(exc)
    except Exception as exc:  # a bug: the frontend still gets a reply, and the type's name
        return ErrorReply(type(exc).__name__, f"internal error: {exc}")
    return ErrorReply("BadRequest", f"unknown call {call!r}")


def _swa(coord: Coordinator, rid, start: int) -> tuple[int, list[int]]:
    """The SWA slots from the window before token ``start`` (the first new one) to the end
    of the request's row; ``(0, [])`` with the full-attention cache."""
    got = coord.mirror.request_swa_slots(rid, start)
    if got is None:
        return 0, []
    return got[0], got[1].tolist()


def _cache_unfinished(coord: Coordinator, rid, tokens) -> CachedReply:
    """``cache_unfinished``, and, when it rewrote the request's row (pages the tree already
    held replace the request's own), the row's slots now and the slots freed."""
    mirror = coord.mirror
    try:
        old = mirror.request_row(rid).pages.copy()
    except CacheError:
        old = None  # the call below raises the right error (unknown, lost, bad id)
    n = coord.cache_unfinished(rid, tokens)
    row = mirror.request_row(rid)
    if old is None or np.array_equal(old, row.pages):
        return CachedReply(n)
    ps = mirror.page_size
    freed = old[old != row.pages]
    return CachedReply(
        n,
        pages_to_slots(row.pages, ps, row.num_tokens).tolist(),
        pages_to_slots(np.sort(freed), ps).tolist(),
        *_swa(coord, rid, row.num_tokens),
    )


def apply_requests(coord: Coordinator, requests: list[list[Call]]) -> list[list[Reply]]:
    """Several frontends' calls as one step, in order: one reply per call. A call the
    cache refuses gets its own ``ErrorReply``; if the step itself fails, every call of it
    gets the (retryable) error."""
    try:
        with coord.batch():
            return [[dispatch(coord, call) for call in calls] for calls in requests]
    except REJECTED as exc:
        err = error_reply(exc, retryable=True)
        return [[err] * len(calls) for calls in requests]


def call_limit(coord: Coordinator) -> int:
    """The largest encoded call ``coord`` can take (``api.max_call_bytes``)."""
    return max_call_bytes(coord.mirror.config.request_limit)


def handle(coord: Coordinator, data: object) -> bytes:
    """One encoded call in, one encoded reply out (its ops form one step). Anything that
    is not a valid call (not bytes, malformed, larger than any valid call: refused before
    it is decoded) gets an ``ErrorReply``."""
    try:
        call = decode_call(data, call_limit(coord))
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
    limit = call_limit(coord)
    for i, data in enumerate(items):
        try:
            calls.append(decode_call(data, limit))
        except CacheError as exc:
            err = encode(ErrorReply("BadRequest", f"call {i} of the batch: {exc}; none applied"))
            return [err] * len(items)
    replies: list[bytes] = []
    try:
        with coord.batch():
            for call in calls:
                replies.append(encode(dispatch(coord, call)))
    except REJECTED as exc:
        # The step itself failed to send or check: every call of it is lost.
        err = encode(error_reply(exc, retryable=True))
        replies = [err] * len(items)
    return replies


def serve_network(
    coord: Coordinator, config: FrontendConfig, lock: threading.Lock | None = None
) -> NetFrontend:
    """Serve ``coord`` on the network frontend (``netfront``). The coordinator is not
    thread-safe: while it is served, call it only under ``lock`` (the frontend's thread
    takes it for each step). A request may carry up to 16 full-size prompts."""
    guard = lock or threading.Lock()

    def run(requests: list[list[Call]]) -> list[list[Reply]]:
        with guard:
            return apply_requests(coord, requests)

    def idle() -> None:
        with guard, contextlib.suppress(*REJECTED):
            coord.flush()

    return NetFrontend(config, run, 16 * call_limit(coord), idle)
