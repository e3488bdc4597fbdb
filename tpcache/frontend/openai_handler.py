"""The OpenAI endpoint's connections: one ``Handler`` per connection (HTTP/1.1, kept
alive), on a thread of the standard library's threading server; what it serves is the
``Served`` record its ``OpenAIServer`` (``openai_http``) hands it.

A completion request is read (its body bounded before it is read), checked
(``openai_records``), submitted (``openai_run``) and answered whole or as server-sent
events. While it waits it looks every ``POLL_S`` for its client leaving (end-of-file on
the socket) and for the server closing; either, a failed write, or a socket blocked for
``CONNECTION_TIMEOUT_S`` cancels its engine requests.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import select
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from tpcache.frontend.openai_records import (
    ApiError,
    check_model,
    choice_body,
    completion_body,
    error_body,
    model_body,
    models_body,
    parse_completion,
    usage_body,
)
from tpcache.frontend.openai_run import CompletionRun, Update
from tpcache.frontend.openai_text import TextCodec
from tpcache.logs import one_line

POLL_S = 0.25  # how often a waiting request looks for its client leaving or a close
CONNECTION_TIMEOUT_S = 60.0
PATHS = {"/v1/completions": "POST", "/v1/models": "GET", "/v1/models/{id}": "GET", "/health": "GET"}  # fmt: skip


@dataclass(frozen=True)
class Served:
    """What every connection of one server shares (read-only but ``closing``)."""

    engine: Any  # tpcache.engine.Engine: submit, cancel, stats
    codec: TextCodec | None
    model_name: str
    api_key: str | None
    max_body_bytes: int
    idle_timeout_s: float
    created: int  # the server's start, as /v1/models reports it
    closing: threading.Event  # set by the server's close: waiting requests end

    def authorized(self, header: str | None) -> bool:
        if self.api_key is None:
            return True
        want = f"Bearer {self.api_key}".encode()
        return header is not None and hmac.compare_digest(header.encode(), want)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (HTTP/1.1, kept alive)."""

    protocol_version = "HTTP/1.1"
    server_version = "tpcache"

    timeout = CONNECTION_TIMEOUT_S  # a socket read or write that blocks longer ends it
    # Headers and body go out as separate writes: with Nagle's algorithm the body would
    # wait for the client's delayed ACK of the headers (40 ms on Linux).
    disable_nagle_algorithm = True

    @property
    def app(self) -> Served:
        return self.server.served  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the endpoint's figures are the engine's; no line per request on stderr

    def do_GET(self) -> None:
        self._route(self.command)

    # every other method: 405 on a known path, else 404
    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _route(self, method: str) -> None:
        path = urllib.parse.unquote(self.path.split("?", 1)[0])
        model = path.removeprefix("/v1/models/") if path.startswith("/v1/models/") else None
        route = path if model is None else "/v1/models/{id}"
        self.body_read = self.streaming = False
        try:
            if route not in PATHS:
                raise ApiError(404, f"no such path: {method} {path}", code="unknown_url")
            if PATHS[route] != method:
                raise ApiError(405, f"{path} takes {PATHS[route]}, not {method}", code="method_not_allowed")  # fmt: skip
            if path != "/health" and not self.app.authorized(self.headers.get("Authorization")):
                self.server.refusals.warning("key", f"OpenAI endpoint refused {method} {one_line(path, 200)} from {self.client_address[0]}: no valid API key (answered 401)")  # type: ignore[attr-defined]  # fmt: skip
                raise ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip
            if path == "/health":
                closed = self.app.closing.is_set() or self.app.engine.stats().get("closed")
                self._send_json(503 if closed else 200, {"status": "closed" if closed else "ok"})
            elif path == "/v1/models":
                self._send_json(200, models_body(self.app.model_name, self.app.created))
            elif model is not None:
                check_model(model, self.app.model_name)
                self._send_json(200, model_body(self.app.model_name, self.app.created))
            else:
                self._complete()
        except ApiError as exc:
            # A body left unread would be taken for the next request: the connection ends.
            unread = self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0"  # fmt: skip
            if unread and not self.body_read:
                self.close_connection = True
            self._send_json(exc.status, exc.body())
        except Exception as exc:  # a fault of this server: answered, the connection ends
            self.close_connection = True
            if not self.streaming:  # else the stream just ends without its [DONE]
                self._send_json(500, error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, None))  # fmt: skip

    def handle_expect_100(self) -> bool:
        """Refuse a body over the limit before the client sends it."""
        try:
            self._body_size()
        except ApiError as exc:
            self.close_connection = True
            self._send_json(exc.status, exc.body())
            return False
        return super().handle_expect_100()

    def _body_size(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(411, "send the body with a Content-Length (no chunked encoding)")
        raw = self.headers.get("Content-Length", "0")
        if not raw.isdigit():
            raise ApiError(400, f"bad Content-Length: {raw!r}")
        if int(raw) > self.app.max_body_bytes:
            raise ApiError(413, f"the request body has {raw} bytes; at most {self.app.max_body_bytes}", code="request_too_large")  # fmt: skip
        return int(raw)

    def _read_body(self) -> object:
        data = self.rfile.read(self._body_size())
        self.body_read = True
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _complete(self) -> None:
        app = self.app
        ask = parse_completion(self._read_body(), app.model_name, app.codec is not None)
        prompts = [p if isinstance(p, tuple) else app.codec.encode(p) for p in ask.prompts]  # type: ignore[union-attr]
        if not all(prompts):
            raise ApiError(400, "a prompt string encodes to no tokens", param="prompt")
        run = CompletionRun(app.engine, prompts, ask.sampling, app.codec, ask.stops)
        if app.closing.is_set():
            raise ApiError(503, "the server is closing", code="unavailable", kind="server_error")
        run.submit()
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        try:
            if ask.stream:
                self._stream(run, cid, created, ask.include_usage)
            else:
                self._gather(run, cid, created)
        finally:
            run.cancel()  # nothing if every choice ended

    def _next(self, run: CompletionRun, since: list[float]) -> list[Update] | None:
        """The next updates, or None after ``POLL_S``; raises ``ApiError`` when the run
        cannot go on (closing, idle too long) and ``ConnectionError`` when the client left."""
        if self.app.closing.is_set():
            raise ApiError(503, "the server is closing", code="unavailable", kind="server_error")
        if self._client_gone():
            raise ConnectionError("the client went away")
        ups = run.updates(POLL_S)
        now = time.monotonic()
        if ups:
            since[0] = now
        elif now - since[0] > self.app.idle_timeout_s:
            raise ApiError(504, f"the engine sent nothing for {self.app.idle_timeout_s:g} s", code="timeout", kind="server_error")  # fmt: skip
        return ups

    def _gather(self, run: CompletionRun, cid: str, created: int) -> None:
        texts = [""] * len(run.choices)
        since = [time.monotonic()]
        try:
            while not run.done:
                for u in self._next(run, since) or ():
                    texts[u.index] += u.text
        except ConnectionError:
            self.close_connection = True
            return
        choices = [
            choice_body(c.index, texts[c.index], list(c.text.tokens), c.finish_reason)
            for c in run.choices
        ]
        self._send_json(200, completion_body(cid, created, self.app.model_name, choices, usage_body(*run.usage())))  # fmt: skip

    def _stream(self, run: CompletionRun, cid: str, created: int, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.streaming = True
        model = self.app.model_name
        since = [time.monotonic()]
        try:
            while not run.done:
                try:
                    ups = self._next(run, since)
                except ApiError as exc:
                    self._event(exc.body())
                    break
                if ups:
                    choices = [
                        choice_body(u.index, u.text, u.token_ids, u.finish_reason) for u in ups
                    ]
                    chunk = completion_body(cid, created, model, choices, None)
                    if include_usage:
                        chunk["usage"] = None  # as OpenAI: on every chunk but the last
                    self._event(chunk)
            if include_usage and run.done:
                self._event(completion_body(cid, created, model, [], usage_body(*run.usage())))
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except OSError:  # the client went away (ConnectionError is an OSError)
            self.close_connection = True  # run.cancel() in _complete frees the slots

    def _event(self, body: dict[str, Any]) -> None:
        self._chunk(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the client closed its side (end-of-file is readable). Bytes of a next
        request waiting on the connection do not count."""
        poller = select.poll()  # not select.select: that fails for descriptors over 1023
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # reset
            return True

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 503:
                self.send_header("Retry-After", "1")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()


__all__ = ["CONNECTION_TIMEOUT_S", "Handler", "Served"]
