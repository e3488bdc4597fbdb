"""Serving the msgspec frontend API on a ``Coordinator``: decode, dispatch, reply.

Nothing a caller sends can crash the coordinator: a malformed message or a rejected call
becomes an ``ErrorReply`` naming the error type; the state is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import msgspec

from tpcache.cache.errors import CacheError
from tpcache.cache.namespace import make_namespace
from tpcache.coordinator.copy_agree import CopiesNotDone
from tpcache.coordinator.core import Coordinator
from tpcache.coordinator.records import Cached, SwaWindow
from tpcache.frontend.api import (
    AbortCall,
    AdmitCall,
    AdmitReply,
    CachedReply,
    CacheUnfinishedCall,
    Call,
    CancelCall,
    CoordinatorUnavailable,
    ErrorReply,
    ExtendCall,
    FinishCall,
    GenerateCall,
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
from tpcache.frontend.netgen import GenerateEngine
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
                # The engine runs its forward as soon as it has the slots: with a host
                # tier, a prefix being loaded must be there first.
                coord.ready_or_abort(scoped)
                return AdmitReply(got.prefix_len, got.slots.tolist(), *_swa(got.swa))
            case ExtendCall(_, n):
                more = coord.extend(scoped, n)
                coord.ready_or_abort(scoped)
                return SlotsReply(more.slots.tolist(), *_swa(more.swa))
            case CacheUnfinishedCall(_, tokens):
                return _cached_reply(coord.cache_unfinished(scoped, tokens))
            case FinishCall(_, output):
                return CachedReply(coord.finish(scoped, output))
            case AbortCall(_):
                coord.abort(scoped)
                return OkReply()
            case StatsCall():
                if owner is not None and figures is not None:
                    return StatsReply(client_stats(coord.stats(), figures.of(owner)))
                return StatsReply(coord.stats())
            case GenerateCall() | CancelCall():
                why = "generate calls go to the network frontend or the Ray client's generate"
                return ErrorReply("BadRequest", why)
    except REJECTED as exc:
        err = error_reply(exc)
    except Exception as exc:  # a bug: the frontend still gets a reply, and the type's name
        err = ErrorReply(type(exc).__name__, f"internal error: {exc}")
    else:
        return ErrorReply("BadRequest", f"unknown call {call!r}")
    if scoped is not rid:
        err = msgspec.structs.replace(err, message=own_message(err.message, scoped, rid))
    return err


def _swa(window: SwaWindow | None) -> tuple[int, list[int]]:
    """A reply's ``swa_start`` and ``swa_slots``: ``(0, [])`` with the full-attention cache."""
    return (0, []) if window is None else (window.start, window.slots.tolist())


def _cached_reply(got: Cached) -> CachedReply:
    """``cache_unfinished``'s reply: with a rewritten row, the row's slots now, the slots
    freed and the last window's SWA slots."""
    w = got.rewrite
    if w is None:
        return CachedReply(got.cached_len)
    return CachedReply(got.cached_len, w.slots.tolist(), w.freed.tolist(), *_swa(w.swa))


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
    return max_call_bytes(coord.request_limit())


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
    coord: Coordinator,
    config: FrontendConfig,
    lock: threading.Lock | None = None,
    engine: GenerateEngine | None = None,
) -> NetFrontend:
    """Serve ``coord`` on the network frontend (``netfront``); the frontend's thread holds
    ``coord.lock`` for each step (and ``lock`` too, if given: a caller's own), so other
    threads may call ``coord`` meanwhile. Generate calls go to ``engine`` (a started
    ``tpcache.engine.Engine`` over ``coord``, which the caller owns and closes after the
    frontend; None: they are answered ``NoModel``). From now
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

    return NetFrontend(config, run, 16 * call_limit(coord), idle, engine)
