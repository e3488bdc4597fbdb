"""Generate calls on the network frontend: handed to a serving engine, answered as the
engine's events come. At most ``max_queue`` (``FrontendConfig``) run at once; more are
answered ``Busy`` (retryable).

The engine calls ``sink`` from its own thread; ZMQ sockets are not thread-safe, so the
events wait in a queue and a byte written to a pipe wakes the frontend's thread (which
polls the pipe beside its socket), and that thread alone sends. A streamed call gets a
``TokensReply`` for each run of tokens the thread finds waiting (one token at a time
when it keeps up, several when it falls behind), then the ``GeneratedReply`` (or an
``ErrorReply``); a whole call gets the last alone.

A streaming client that is gone is cancelled: its connection closed (the ROUTER's
mandatory routing refuses the send) or it stopped reading (ZMQ's queues for it are
full: past its high-water marks, a thousand messages or more). ``tpcache.client``
cancels a stream whose iterator it closes, and asks for a stream even for a whole
answer; a client of the wire's whole form that goes away is noticed only when its
answer is sent.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tpcache.engine.requests import (
    Failed,
    Finished,
    GenerateRequest,
    GenEvent,
    TokenOut,
)
from tpcache.errors import TpcacheError
from tpcache.frontend import api
from tpcache.frontend.owners import Owner, own_message, scoped_id


class GenerateEngine(Protocol):
    """What the frontend needs of ``tpcache.engine.Engine``."""

    def submit(self, request: GenerateRequest, sink: Callable[[GenEvent], None]) -> None: ...

    def cancel(self, rid: Any) -> bool: ...


def engine_calls(calls: list[api.Call]) -> bool:
    """Whether a request's calls are the engine's (generate, cancel), not the cache's."""
    return any(isinstance(c, api.GenerateCall | api.CancelCall) for c in calls)


def final_reply(event: Finished | Failed) -> api.Reply:
    """The last reply of a generate call: its result, or its typed error."""
    if isinstance(event, Failed):
        return api.error_reply(event.error)
    return api.GeneratedReply(
        list(event.tokens),
        event.reason,
        event.prompt_tokens,
        event.cached_tokens,
        event.preemptions,
        event.recoveries,
        event.computed_tokens,
    )


@dataclass
class Stream:
    """One running generate call, as the frontend's thread keeps it (its only)."""

    head: list[bytes]  # routing id and message id: where its replies go
    request_id: Any  # the client's own id (errors name it)
    stream: bool
    sent: int = 0  # tokens sent so far
    gone: bool = False  # its client is gone: cancelled, its last events dropped
    waiting: list[int] = field(default_factory=list)  # tokens not sent yet


Send = Callable[[list[bytes], bytes], bool]


class NetGenerate:
    """The generate calls of one network frontend. ``engine`` None: the server serves no
    model, and a generate call is answered ``NoModel``. ``send(head, body)`` sends on the
    frontend's socket and says whether ZMQ took it. Every method but ``sink`` runs on the
    frontend's thread."""

    def __init__(self, engine: GenerateEngine | None, send: Send, limit: int = 4096) -> None:
        self.engine = engine
        self._send = send
        self.limit = limit  # generate calls running at once; more are answered Busy
        self._events: queue.SimpleQueue[GenEvent] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()  # the write end against close; -1 once closed
        self._live: dict[Any, Stream] = {}  # by the engine's request id
        self.dropped = 0  # streams cancelled because their client was gone

    @property
    def fd(self) -> int:
        """Readable when events wait (for the frontend's poller)."""
        return self._wake_r

    @property
    def running(self) -> int:
        return len(self._live)

    def sink(self, event: GenEvent) -> None:
        """Take one of the engine's events (any thread)."""
        self._events.put(event)
        with self._pipe_lock:  # never a write to a closed (and perhaps reused) fd
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread anyway
                os.write(self._wake_w, b"\0")

    def take(self, owner: Owner, head: list[bytes], calls: list[api.Call]) -> list[api.Reply]:
        """Start or cancel what ``calls`` ask: the replies to send now (none for a
        generate call that started: its answer comes with the events)."""
        if len(calls) != 1 and any(isinstance(c, api.GenerateCall) for c in calls):
            why = "a generate call must be the only call of its message"
            return [api.ErrorReply("BadRequest", why)] * len(calls)
        if not all(isinstance(c, api.GenerateCall | api.CancelCall) for c in calls):
            why = "cancel calls cannot share a message with cache calls"
            return [api.ErrorReply("BadRequest", why)] * len(calls)
        if self.engine is None:
            why = "this server serves no model (start it with `tpcache serve --model DIR`)"
            return [api.error_reply(api.NoModel(why))] * len(calls)
        replies: list[api.Reply] = []
        for call in calls:
            got = self._start(owner, head, call) if isinstance(call, api.GenerateCall) else None
            if isinstance(call, api.CancelCall):
                got = self._cancel(owner, call)
            if got is not None:
                replies.append(got)
        return replies

    def _start(self, owner: Owner, head: list[bytes], call: api.GenerateCall) -> api.Reply | None:
        assert self.engine is not None
        if len(self._live) >= self.limit:
            why = f"{self.limit} generate calls are running here; retry shortly"
            return api.error_reply(api.Busy(why))
        rid: Any = call.request_id
        try:
            rid = scoped_id(owner, call.request_id)
            request = call.as_request(rid)
            if rid in self._live:  # its events still wait here after the engine let go
                raise api.BadRequest(f"request {call.request_id!r} is still running")
            self._live[rid] = Stream(head, call.request_id, call.stream)
            try:
                self.engine.submit(request, self.sink)
            except BaseException:
                del self._live[rid]
                raise
        except TpcacheError as exc:
            err = api.error_reply(exc)
            return msgspec.structs.replace(
                err, message=own_message(err.message, str(rid), call.request_id)
            )
        return None

    def _cancel(self, owner: Owner, call: api.CancelCall) -> api.Reply:
        assert self.engine is not None
        try:
            rid = scoped_id(owner, call.request_id)
        except TpcacheError as exc:
            return api.error_reply(exc)
        return api.CancelReply(rid in self._live and self.engine.cancel(rid))

    def drain(self) -> None:
        """Send what the engine's events waiting now say, in order; cancel the streams
        whose client is gone."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        touched: dict[Any, Stream] = {}
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            s = self._live.get(event.rid)
            if s is None:
                continue
            if isinstance(event, TokenOut):
                if s.stream and not s.gone and event.index >= s.sent + len(s.waiting):
                    s.waiting.append(event.token)
                    touched[event.rid] = s
                continue
            self._flush(event.rid, s)
            del self._live[event.rid]
            touched.pop(event.rid, None)
            if not s.gone:
                reply = final_reply(event)
                if isinstance(reply, api.ErrorReply):
                    reply = msgspec.structs.replace(
                        reply, message=own_message(reply.message, str(event.rid), s.request_id)
                    )
                self._send(s.head, api.encode_replies([reply]))
        for rid, s in touched.items():
            self._flush(rid, s)

    def _flush(self, rid: Any, s: Stream) -> None:
        if not s.waiting or s.gone:
            return
        body = api.encode_replies([api.TokensReply(s.sent, s.waiting)])
        s.sent += len(s.waiting)
        s.waiting = []
        if not self._send(s.head, body):
            s.gone = True
            self.dropped += 1
            if self.engine is not None:
                self.engine.cancel(rid)

    def close(self) -> None:
        """Cancel every running call (the engine frees their slots); close the pipe."""
        if self.engine is not None:
            for rid in list(self._live):
                with contextlib.suppress(Exception):
                    self.engine.cancel(rid)
        self._live.clear()
        with self._pipe_lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1


__all__ = ["GenerateEngine", "NetGenerate", "engine_calls", "final_reply"]
