"""The frontend API as msgspec messages: what a serving frontend sends, what it gets back.

Calls are a tagged union (tag field ``call``); unknown fields are rejected. Replies are
another tagged union (tag field ``reply``). Errors come back as ``ErrorReply`` naming the
error type, so a client raises the same typed error the coordinator raised.
"""

from __future__ import annotations

from typing import TypedDict

import msgspec

from tpcache.cache import errors as cache_errors
from tpcache.cache.records import RequestId
from tpcache.coordinator.errors import CoordinatorUnavailable, RequestLost
from tpcache.errors import TpcacheError


class _Call(msgspec.Struct, tag_field="call", frozen=True, forbid_unknown_fields=True):
    pass


class NamespaceFields(TypedDict, total=False):
    """A client's keyword arguments for an admit's cache namespace (``AdmitCall``)."""

    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None


class AdmitCall(_Call, tag="admit"):
    """``lora_id``, ``lora_name``, ``cache_salt``: the request's cache namespace (a LoRA
    adapter, a tenant's salt; all ``None``: the default one). Equal tokens in different
    namespaces never share KV (``cache.namespace``)."""

    request_id: RequestId
    tokens: list[int]
    priority: int = 0
    reserve: int = 0
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class ExtendCall(_Call, tag="extend"):
    request_id: RequestId
    n: int


class CacheUnfinishedCall(_Call, tag="cache_unfinished"):
    request_id: RequestId
    tokens: list[int]


class FinishCall(_Call, tag="finish"):
    request_id: RequestId
    output_tokens: list[int] = []


class AbortCall(_Call, tag="abort"):
    request_id: RequestId


class StatsCall(_Call, tag="stats"):
    pass


Call = AdmitCall | ExtendCall | CacheUnfinishedCall | FinishCall | AbortCall | StatsCall


class _Reply(msgspec.Struct, tag_field="reply", frozen=True):
    pass


# With the hybrid (sliding-window) cache, a reply that hands out slots also gives
# ``swa_slots``: the SWA-pool slots of the request's tokens from ``swa_start`` to the end
# of its row, that is, the window the new tokens attend to (sliding layers read it) and
# the new tokens themselves (sliding layers write there). Empty with the full-attention
# cache.


class AdmitReply(_Reply, tag="admit"):
    prefix_len: int
    slots: list[int]
    swa_start: int = 0
    swa_slots: list[int] = []


class SlotsReply(_Reply, tag="slots"):
    slots: list[int]
    swa_start: int = 0
    swa_slots: list[int] = []


class CachedReply(_Reply, tag="cached"):
    """``row``: after a ``cache_unfinished`` that rewrote the request's row (its cached
    pages became the tree's), the request's slots now; ``freed``: the slots it held
    before that are free now (stale for the frontend). Both empty when nothing moved;
    with the hybrid cache a rewrite also gives the last window's SWA slots now."""

    cached_tokens: int
    row: list[int] = []
    freed: list[int] = []
    swa_start: int = 0
    swa_slots: list[int] = []


class OkReply(_Reply, tag="ok"):
    pass


class StatsReply(_Reply, tag="stats"):
    stats: dict[str, bool | int | float | str | list[int | str] | None]


class ErrorReply(_Reply, tag="error"):
    error: str  # the exception type's name
    message: str
    retryable: bool = False
    # The step a lockstep error (``RankFailure``, ``DivergenceError``) names, so a client
    # rebuilds it with that ``step``; None for other errors, and from a server older
    # than this field (a client of that age ignores it).
    step: int | None = None


Reply = AdmitReply | SlotsReply | CachedReply | OkReply | StatsReply | ErrorReply


class BadRequest(cache_errors.CacheError, ValueError):
    """A message that is not a valid call (malformed bytes, wrong types, unknown fields)."""


class Busy(TpcacheError, RuntimeError):
    """The network frontend has more calls waiting than it takes; retry shortly."""

    retryable = True


class Unauthenticated(TpcacheError, RuntimeError):
    """The network frontend needs a valid token (or CURVE keys) for this request."""


class OutcomeUnknown(TpcacheError, TimeoutError):
    """No reply came in time: the calls may or may not have been applied, so they are
    not to be made again as new calls. ``Client.resend(err)`` sends the same request
    again (``message_id``, ``body``); the server applies it at most once and answers
    what it answered the first time."""

    retryable = False

    def __init__(self, message: str, message_id: bytes = b"", body: bytes = b"") -> None:
        super().__init__(message)
        self.message_id = message_id
        self.body = body


_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_calls_decoder = msgspec.msgpack.Decoder(list[Call])
_replies_decoder = msgspec.msgpack.Decoder(list[Reply])


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def max_call_bytes(request_limit: int) -> int:
    """The largest encoded call that can be valid for a cache whose requests hold at most
    ``request_limit`` tokens: every token id at most 5 msgpack bytes, plus room for the
    rest of the call. A frontend refuses a larger message before decoding it."""
    return 5 * request_limit + 4096


def decode_call(data: object, max_bytes: int | None = None) -> Call:
    """Decode a call; raises ``BadRequest`` saying what was wrong (also for something
    that is not bytes at all, or larger than ``max_bytes``, checked before decoding)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BadRequest(f"a call must be msgpack bytes, got {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise BadRequest(
            f"a call of {len(data):,} bytes is larger than any valid call here ({max_bytes:,})"
        )
    try:
        return _call_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"malformed call: {exc}") from None


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def decode_calls(data: object, max_bytes: int) -> list[Call]:
    """A list of calls (one step over the network frontend); ``BadRequest`` as
    ``decode_call`` (size checked first, before decoding)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BadRequest(f"calls must be msgpack bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise BadRequest(f"a message of {len(data):,} bytes is over the limit ({max_bytes:,})")
    try:
        calls = _calls_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"malformed calls: {exc}") from None
    if not calls:
        raise BadRequest("a message must carry at least one call")
    return calls


def encode_calls(calls: list[Call]) -> bytes:
    return _encoder.encode(calls)


def encode_replies(replies: list[Reply]) -> bytes:
    return _encoder.encode(replies)


def decode_replies(data: bytes) -> list[Reply]:
    return _replies_decoder.decode(data)


def error_types() -> dict[str, type[BaseException]]:
    """Every error a reply may name, by type name (for clients to re-raise them)."""
    from tpcache.lockstep.errors import DivergenceError, LockstepError, RankFailure

    found: dict[str, type[BaseException]] = {}
    for obj in vars(cache_errors).values():
        if isinstance(obj, type) and issubclass(obj, BaseException):
            found[obj.__name__] = obj
    for cls in (
        BadRequest,
        Busy,
        Unauthenticated,
        CoordinatorUnavailable,
        RequestLost,
        DivergenceError,
        LockstepError,
        RankFailure,
    ):
        found[cls.__name__] = cls
    return found


def error_reply(exc: BaseException, retryable: bool | None = None) -> ErrorReply:
    """``exc`` as the reply that names it: its type's name, its message, ``retryable``
    (None: the error's own), and the step of a lockstep error. Changes nothing."""
    from tpcache.lockstep.errors import LockstepError

    retry = bool(getattr(exc, "retryable", False)) if retryable is None else retryable
    step = exc.step if isinstance(exc, LockstepError) else None
    return ErrorReply(type(exc).__name__, str(exc), retry, step)


class RemoteError(TpcacheError, RuntimeError):
    """An error from the coordinator whose type this client does not know."""


def raise_reply_error(reply: ErrorReply) -> None:
    """Raise the typed error an ``ErrorReply`` names (``RemoteError`` if unknown here). A
    lockstep error gets the reply's ``step`` and the message it had (``"step N: ..."``);
    from a server that sends no step, step -1 (its message then reads ``"step -1: step
    N: ..."``, as before the field)."""
    from tpcache.lockstep.errors import LockstepError

    cls = error_types().get(reply.error)
    if cls is None:
        raise RemoteError(f"{reply.error}: {reply.message}")
    if issubclass(cls, LockstepError):
        if reply.step is None:
            raise cls(-1, reply.message)
        raise cls(reply.step, reply.message.removeprefix(f"step {reply.step}: "))
    raise cls(reply.message)
