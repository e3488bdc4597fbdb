"""The errors the frontend itself raises or a client raises for it (the coordinator's and
the cache's own are theirs). Plain exception classes, no imports beyond ``errors``, so
``api`` and the torch-free client share them; ``api`` re-exports every one."""

from __future__ import annotations

from typing import Protocol

from tpcache.cache import errors as cache_errors
from tpcache.errors import TpcacheError


class BadRequest(cache_errors.CacheError, ValueError):
    """A message that is not a valid call (malformed bytes, wrong types, unknown fields)."""


class Busy(TpcacheError, RuntimeError):
    """The network frontend has more calls waiting than it takes; retry shortly."""

    retryable = True


class Unauthenticated(TpcacheError, RuntimeError):
    """The network frontend needs a valid token (or CURVE keys) for this request."""


class NoModel(TpcacheError, RuntimeError):
    """A generate call reached a server that serves no model (an index service: it
    answers cache calls only). Start it with ``tpcache serve --model DIR``."""


class GenerateTimeout(TpcacheError, TimeoutError):
    """No part of a generate call's answer came within the client's ``timeout_s``; the
    client cancelled the request (the tokens it had yielded stay valid)."""

    retryable = True


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


class RemoteError(TpcacheError, RuntimeError):
    """An error from the coordinator whose type this client does not know."""


FRONTEND_ERRORS: tuple[type[TpcacheError], ...] = (
    BadRequest,
    Busy,
    Unauthenticated,
    NoModel,
    GenerateTimeout,
    OutcomeUnknown,
    RemoteError,
)


class NamedError(Protocol):
    """What an ``api.ErrorReply`` carries of the error it names."""

    error: str
    message: str
    step: int | None


def error_types() -> dict[str, type[BaseException]]:
    """Every error a reply may name, by type name (for clients to re-raise them)."""
    from tpcache.coordinator.errors import CoordinatorUnavailable, RequestLost
    from tpcache.engine import errors as engine_errors
    from tpcache.engine import requests as engine_requests
    from tpcache.lockstep.errors import DivergenceError, LockstepError, RankFailure

    found: dict[str, type[BaseException]] = {}
    # The engine's after the cache's: its DuplicateRequest is the cache's, refined.
    for module in (cache_errors, engine_requests, engine_errors):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException):
                found[obj.__name__] = obj
    for cls in (
        *FRONTEND_ERRORS,
        CoordinatorUnavailable,
        RequestLost,
        DivergenceError,
        LockstepError,
        RankFailure,
    ):
        found[cls.__name__] = cls
    return found


def raise_reply_error(reply: NamedError) -> None:
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


__all__ = [
    "FRONTEND_ERRORS",
    "BadRequest",
    "Busy",
    "GenerateTimeout",
    "NoModel",
    "OutcomeUnknown",
    "RemoteError",
    "Unauthenticated",
    "error_types",
    "raise_reply_error",
]
