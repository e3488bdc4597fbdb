"""The serving engine's errors. Each is a ``TpcacheError`` that keeps the builtin base a
caller would catch, and says (``retryable``) whether sending the request again may
succeed."""

from __future__ import annotations

from tpcache.cache.errors import DuplicateRequest as CacheDuplicate
from tpcache.errors import TpcacheError


class EngineConfigError(TpcacheError, ValueError):
    """A field of ``EngineConfig`` is invalid; the message names it."""


class NotAnEngineConfig(EngineConfigError, TypeError):
    """An engine was given something other than an ``EngineConfig`` as its config."""


class DuplicateRequest(CacheDuplicate):
    """A request id that is live in the engine already (queued or generating)."""

    retryable = False


class RequestTooLarge(TpcacheError, ValueError):
    """A request whose prompt and output can never fit in the cache's capacity for one
    request: nothing was queued or held."""

    retryable = False


class EngineClosed(TpcacheError, RuntimeError):
    """The engine is closed (or closing): a submitted request is refused, a live one ends
    with this. Another engine may serve it."""

    retryable = True


class GenerationFailed(TpcacheError, RuntimeError):
    """A request could not continue: its TP group failed and did not come back in time,
    its recovery was stopped, or it was re-admitted too often. The tokens sent before
    stay valid; sending the request again may succeed."""

    retryable = True


__all__ = [
    "DuplicateRequest",
    "EngineClosed",
    "EngineConfigError",
    "GenerationFailed",
    "NotAnEngineConfig",
    "RequestTooLarge",
]
