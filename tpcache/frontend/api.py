"""The frontend API as msgspec messages: what a serving frontend sends, what it gets back.

Calls are a tagged union (tag field ``call``); unknown fields are rejected. Replies are
another tagged union (tag field ``reply``). Errors come back as ``ErrorReply`` naming the
error type, so a client raises the same typed error the coordinator raised (the
frontend's own errors are in ``api_errors``, and re-exported here).
"""

from __future__ import annotations

from typing import TypedDict

import msgspec

from tpcache.cache.records import RequestId
from tpcache.coordinator.errors import CoordinatorUnavailable as CoordinatorUnavailable
from tpcache.coordinator.errors import RequestLost as RequestLost
from tpcache.engine.requests import GenerateRequest, SamplingParams
from tpcache.frontend.api_errors import BadRequest as BadRequest
from tpcache.frontend.api_errors import Busy as Busy
from tpcache.frontend.api_errors import GenerateTimeout as GenerateTimeout
from tpcache.frontend.api_errors import NoModel as NoModel
from tpcache.frontend.api_errors import OutcomeUnknown as OutcomeUnknown
from tpcache.frontend.api_errors import RemoteError as RemoteError
from tpcache.frontend.api_errors import Unauthenticated as Unauthenticated
from tpcache.frontend.api_errors import error_types as error_types
from tpcache.frontend.api_errors import raise_reply_error as raise_reply_error


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


class GenerateCall(_Call, tag="generate"):
    """Generate up to ``max_new_tokens`` after ``prompt`` (token ids) on a server that
    serves a model; the sampling fields are ``engine.requests.SamplingParams``'. Its
    request is a message of its own. ``stream``: a ``TokensReply`` as tokens are
    sampled, then the ``GeneratedReply``; else that reply alone, at the end."""

    request_id: RequestId
    prompt: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False

    def as_request(self, rid: RequestId) -> GenerateRequest:
        """The engine's request for this call, known as ``rid``. Raises ``BadSampling``
        naming a field that is out of range (or of a wrong type: a record built here,
        not decoded, is not type-checked)."""
        f = msgspec.structs.asdict(self)
        del f["request_id"], f["prompt"], f["stream"]
        f["stop_token_ids"] = tuple(self.stop_token_ids)
        return GenerateRequest(rid, tuple(self.prompt), SamplingParams(**f))


class CancelCall(_Call, tag="cancel"):
    """Stop a running generate call of this client (its KV slots come back); its answer
    ends with finish reason ``cancelled``."""

    request_id: RequestId


Call = (
    AdmitCall
    | ExtendCall
    | CacheUnfinishedCall
    | FinishCall
    | AbortCall
    | StatsCall
    | GenerateCall
    | CancelCall
)


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


class TokensReply(_Reply, tag="tokens"):
    """Tokens of a streamed generate call as they are sampled: ``start`` is the index of
    the first of them in the output (the replies of one call follow each other)."""

    start: int
    tokens: list[int]


class GeneratedReply(_Reply, tag="generated"):
    """A generate call's answer: every output token, why it stopped (``length``,
    ``stop``, ``cancelled``), the prompt's length and how many of its tokens came from
    the cache, how often it was preempted or re-run after a group recovery, and the
    prefill tokens computed for it over all its admissions."""

    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    preemptions: int = 0
    recoveries: int = 0
    computed_tokens: int = 0


class CancelReply(_Reply, tag="cancel"):
    """``cancelled``: the request was running and is being stopped (False: it had ended
    or never existed)."""

    cancelled: bool


Reply = (
    AdmitReply
    | SlotsReply
    | CachedReply
    | OkReply
    | StatsReply
    | ErrorReply
    | TokensReply
    | GeneratedReply
    | CancelReply
)


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


def error_reply(exc: BaseException, retryable: bool | None = None) -> ErrorReply:
    """``exc`` as the reply that names it: its type's name, its message, ``retryable``
    (None: the error's own), and the step of a lockstep error. Changes nothing."""
    from tpcache.lockstep.errors import LockstepError

    retry = bool(getattr(exc, "retryable", False)) if retryable is None else retryable
    step = exc.step if isinstance(exc, LockstepError) else None
    return ErrorReply(type(exc).__name__, str(exc), retry, step)
