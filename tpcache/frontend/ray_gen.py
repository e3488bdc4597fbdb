"""Generate calls of the Ray service (``service.CoordinatorService``), by polling: one
actor call starts a request, and the client's polls collect its answer as it comes.

Polling, not a Ray streaming generator: the service is a threaded actor with a few
threads that every frontend's calls share, and a generator method would hold one of
them for a whole generation. A poll holds one for at most ``wait_s`` (a fraction of a
second), and returns every reply waiting then: a ``TokensReply`` with the tokens
sampled since the last poll (streamed calls), and the last reply once the request ends.

A request whose client stops polling is cancelled after ``abandon_s``, and its replies
are dropped (a client that died cannot tell the service).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tpcache.engine.requests import Failed, Finished, GenEvent, TokenOut
from tpcache.errors import TpcacheError
from tpcache.frontend import api
from tpcache.frontend.netgen import GenerateEngine, final_reply
from tpcache.frontend.owners import Owner, own_message, scoped_id


@dataclass
class Polled:
    """One request's answer so far (under ``RayGenerate``'s condition)."""

    request_id: Any  # the client's own id (errors name it)
    stream: bool
    seen: float  # time.monotonic() of its start or last poll
    start: int = 0  # index of the first token in ``tokens``
    tokens: list[int] = field(default_factory=list)  # sampled, not polled yet
    last: api.Reply | None = None  # its final reply, once it ended


class RayGenerate:
    """The Ray service's generate calls over ``engine`` (None: the group runs no model,
    and a generate call is answered ``NoModel``). Thread-safe: Ray's threads call
    ``start``, ``poll`` and ``cancel``; the engine's thread calls ``sink``."""

    def __init__(self, engine: GenerateEngine | None, abandon_s: float = 60.0) -> None:
        self.engine = engine
        self.abandon_s = abandon_s
        self._cv = threading.Condition()
        self._polled: dict[Any, Polled] = {}  # by the engine's request id, under _cv
        self.abandoned = 0  # requests cancelled because no one polled them

    def start(self, data: bytes, owner: Owner) -> bytes:
        """Submit the encoded ``GenerateCall``; an encoded ``OkReply``, or the
        ``ErrorReply`` of a refusal (nothing is held then)."""
        try:
            call = api.decode_call(data, 1 << 26)
            if not isinstance(call, api.GenerateCall):
                raise api.BadRequest(f"expected a generate call, got {type(call).__name__}")
        except api.BadRequest as exc:
            return api.encode(api.error_reply(exc))
        if self.engine is None:
            why = "this coordinator serves no model (serve one with `tpcache serve --model`)"
            return api.encode(api.error_reply(api.NoModel(why)))
        self.sweep()
        rid: Any = call.request_id
        try:
            rid = scoped_id(owner, call.request_id)
            request = call.as_request(rid)
            with self._cv:
                if rid in self._polled:  # ended, its answer not polled yet
                    raise api.BadRequest(f"request {call.request_id!r} is still running")
                self._polled[rid] = Polled(call.request_id, call.stream, time.monotonic())
            try:
                self.engine.submit(request, lambda event: self._sink(rid, event))
            except BaseException:
                with self._cv:
                    del self._polled[rid]
                raise
        except TpcacheError as exc:
            err = api.error_reply(exc)
            msg = own_message(err.message, str(rid), call.request_id)
            return api.encode(api.ErrorReply(err.error, msg, err.retryable, err.step))
        return api.encode(api.OkReply())

    def _sink(self, rid: Any, event: GenEvent) -> None:
        with self._cv:
            p = self._polled.get(rid)
            if p is None:
                return
            if isinstance(event, TokenOut):
                if p.stream and event.index >= p.start + len(p.tokens):
                    p.tokens.append(event.token)
            elif isinstance(event, Finished | Failed):
                reply = final_reply(event)
                if isinstance(reply, api.ErrorReply):
                    msg = own_message(reply.message, str(rid), p.request_id)
                    reply = api.ErrorReply(reply.error, msg, reply.retryable, reply.step)
                p.last = reply
            self._cv.notify_all()

    def poll(self, owner: Owner, request_id: Any, wait_s: float) -> list[bytes]:
        """The encoded replies of ``request_id`` waiting now, after waiting up to
        ``wait_s`` (at most 5 s) for one: tokens sampled since the last poll, then the
        last reply, after which the request is forgotten. An unknown request gets an
        ``UnknownRequest`` error."""
        try:
            rid = scoped_id(owner, request_id)
        except TpcacheError as exc:
            return [api.encode(api.error_reply(exc))]
        deadline = time.monotonic() + min(max(wait_s, 0.0), 5.0)
        with self._cv:
            p = self._polled.get(rid)
            if p is None:
                err = api.ErrorReply("UnknownRequest", f"no generate call {request_id!r} runs")
                return [api.encode(err)]
            while not p.tokens and p.last is None and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            p.seen = time.monotonic()
            out: list[api.Reply] = []
            if p.tokens:
                out.append(api.TokensReply(p.start, p.tokens))
                p.start += len(p.tokens)
                p.tokens = []
            if p.last is not None:
                out.append(p.last)
                del self._polled[rid]
        return [api.encode(r) for r in out]

    def cancel(self, owner: Owner, request_id: Any) -> bytes:
        """Stop a running request (an encoded ``CancelReply``); its answer ends with
        finish reason ``cancelled``."""
        try:
            rid = scoped_id(owner, request_id)
        except TpcacheError as exc:
            return api.encode(api.error_reply(exc))
        with self._cv:
            known = rid in self._polled
        stopped = known and self.engine is not None and self.engine.cancel(rid)
        return api.encode(api.CancelReply(stopped))

    def sweep(self) -> None:
        """Cancel the requests no one polled for ``abandon_s``, and forget them."""
        now = time.monotonic()
        with self._cv:
            gone = [rid for rid, p in self._polled.items() if now - p.seen > self.abandon_s]
            for rid in gone:
                del self._polled[rid]
        for rid in gone:
            self.abandoned += 1
            if self.engine is not None:
                self.engine.cancel(rid)

    @property
    def running(self) -> int:
        with self._cv:
            return len(self._polled)


__all__ = ["Polled", "RayGenerate"]
