"""Serving the msgspec frontend API on a ``Coordinator``: decode, dispatch, reply.

Nothing a caller sends can crash the coordinator: a malformed message or a rejected call
becomes an ``ErrorReply`` naming the error type; the state is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import msgspec
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
from tpcache.frontend.owners import (
    ClientFigures,
    Owner,
    bound_salt,
    client_stats,
    own_message,
    scoped_id,
)
from tpcache.workers.protocol import LockstepError

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


def dispatch(
    coord: Coordinator,
    call: Call,
    owner: Owner | None = None,
    figures: ClientFigures | None = None,
) -> Reply:
    """Run one call; typed errors become an ``ErrorReply``. With an ``owner`` its request
    ids and cache salt are scoped to it (``owners``); with ``figures`` too, its stats are
    its own figures and the group's health, not the whole group's."""
    rid = getattr(call, "request_id", None)
    scoped = rid
    try:
        if owner is not None and rid is not None:
            scoped = scoped_id(owner, rid)
        match call:
            case AdmitCall(_, tokens, priority, reserve):
                salt = call.cache_salt if owner is None else bound_salt(owner, call.cache_salt)
                space = make_namespace(call.lora_id, call.lora_name, salt)
                got = coord.admit(scoped, tokens, priority, reserve, space)
                if owner is not None and figures is not None:
                    figures.admitted(owner, len(tokens), got.prefix_len)
                _wait_ready(coord, scoped)
                return AdmitReply(
                    got.prefix_len, got.slots.tolist(), *_swa(coord, scoped, got.prefix_len)
                )
            case ExtendCall(_, n):
                slots = coord.extend(scoped, n)
                _wait_ready(coord, scoped)
                start = coord.mirror.request_row(scoped).num_tokens - slots.size
                return SlotsReply(slots.tolist(), *_swa(coord, scoped, start))
            case CacheUnfinishedCall(_, tokens):
                return _cache_unfinished(coord, scoped, tokens)
            case FinishCall(_, output):
                return CachedReply(coord.finish(scoped, output))
            case AbortCall(_):
                coord.abort(scoped)
                return OkReply()
            case StatsCall():
                if owner is not None and figures is not None:
                    return StatsReply(client_stats(coord.stats(), figures.of(owner)))
                return StatsReply(coord.stats())
    except REJECTED as exc:
        err = error_reply(exc)
    except Exception as exc:  # a bug: the frontend still gets a reply, and the type's name
        err = ErrorReply(type(exc).__name__, f"internal error: {exc}")
    else:
        return ErrorReply("BadRequest", f"unknown call {call!r}")
    if scoped is not rid:
        err = msgspec.structs.replace(err, message=own_message(err.message, scoped, rid))
    return err


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


def apply_requests(
    coord: Coordinator,
    requests: list[tuple[Owner | None, list[Call]]],
    figures: ClientFigures | None = None,
) -> list[list[Reply]]:
    """Several clients' calls as one step, in order: one reply per call, each call run
    as its owner's (``dispatch``). A call the cache refuses gets its own ``ErrorReply``;
    if the step itself fails, every call of it gets the (retryable) error."""
    try:
        with coord.batch():
            return [
                [dispatch(coord, call, owner, figures) for call in calls]
                for owner, calls in requests
            ]
    except REJECTED as exc:
        err = error_reply(exc, retryable=True)
        return [[err] * len(calls) for _, calls in requests]


def call_limit(coord: Coordinator) -> int:
    """The largest encoded call ``coord`` can take (``api.max_call_bytes``)."""
    return max_call_bytes(coord.mirror.config.request_limit)


def handle(coord: Coordinator, data: object, owner: Owner | None = None) -> bytes:
    """One encoded call in, one encoded reply out (its ops form one step). Anything that
    is not a valid call (not bytes, malformed, larger than any valid call: refused before
    it is decoded) gets an ``ErrorReply``."""
    try:
        call = decode_call(data, call_limit(coord))
    except CacheError as exc:
        return encode(ErrorReply(type(exc).__name__, str(exc)))
    return encode(dispatch(coord, call, owner))


def handle_many(coord: Coordinator, items: object, owner: Owner | None = None) -> list[bytes]:
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
                replies.append(encode(dispatch(coord, call, owner)))
    except REJECTED as exc:
        # The step itself failed to send or check: every call of it is lost.
        err = encode(error_reply(exc, retryable=True))
        replies = [err] * len(items)
    return replies


def serve_network(
    coord: Coordinator, config: FrontendConfig, lock: threading.Lock | None = None
) -> NetFrontend:
    """Serve ``coord`` on the network frontend (``netfront``); the frontend's thread holds
    ``coord.lock`` for each step (and ``lock`` too, if given: a caller's own), so other
    threads may call ``coord`` meanwhile. From now
    on a failure is recovered in the background (``recover_in_background``): network
    clients are answered ``CoordinatorUnavailable`` at once while it runs. A request may
    carry up to 16 full-size prompts."""
    coord.config = dataclasses.replace(coord.config, recover_in_background=True)
    guard = contextlib.nullcontext() if lock is None else lock

    figures = ClientFigures()

    def run(requests: list[tuple[Owner, list[Call]]]) -> list[list[Reply]]:
        with guard, coord.lock:
            return apply_requests(coord, list(requests), figures)

    def idle() -> None:
        with guard, contextlib.suppress(*REJECTED):
            coord.flush()

    return NetFrontend(config, run, 16 * call_limit(coord), idle)
