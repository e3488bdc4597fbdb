"""An OpenAI-compatible HTTP endpoint over the serving engine: ``POST /v1/completions``
(plain or streamed as server-sent events), ``GET /v1/models``, ``GET /health``. The
standard library's threading HTTP server, one thread per connection; what a request
may hold is in ``openai_records``, how text and stop strings go in ``openai_text``.

Extensions to OpenAI's completion API: each choice carries ``token_ids``, the tokens it
generated (in a streamed chunk, the chunk's new ones), so a client without the model's
tokenizer can read the output; without a tokenizer ``text`` is "". ``finish_reason`` is
``cancelled`` for a request the engine cancelled (the server closing). ``usage`` has
``prompt_tokens_details.cached_tokens``, the prompt tokens the prefix cache held.

A client that goes away (its socket reads end-of-file while it waits, or a streamed
write fails) has its engine requests cancelled, so their slots come back at once.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tpcache.errors import TpcacheError
from tpcache.frontend.openai_records import (
    ApiError,
    choice_body,
    completion_body,
    models_body,
    parse_completion,
    usage_body,
)
from tpcache.frontend.openai_run import CompletionRun, Update
from tpcache.frontend.openai_text import TextCodec
from tpcache.transport.netsec import is_loopback

MAX_BODY_BYTES = 16 << 20
POLL_S = 0.25  # how often a waiting request looks for its client leaving or a close
PATHS = {"/v1/completions": "POST", "/v1/models": "GET", "/health": "GET"}


class OpenAIConfigError(TpcacheError, ValueError):
    """An ``OpenAIServer`` that may not be built as asked (its message says why)."""


class OpenAIServer:
    """The endpoint over ``engine`` (a started ``tpcache.engine.Engine``, which the
    caller keeps and closes). Serves the model as ``model_name``; text prompts and stop
    strings need ``tokenizer_dir`` to hold a ``tokenizer.json``.

    Binds ``host`` (loopback by default) on ``port`` (0: any free one) at ``start()``.
    A host that is not loopback must have ``api_key``: every call but ``/health`` must
    then carry ``Authorization: Bearer <api_key>``; without one the constructor raises
    ``OpenAIConfigError``, as it does for a ``tokenizer.json`` that does not load. A
    request body over ``max_body_bytes`` is refused (413) before it is read. A request
    whose engine sends nothing for ``idle_timeout_s`` is cancelled (504)."""

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "tpcache",
        tokenizer_dir: str | None = None,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        idle_timeout_s: float = 300.0,
    ) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise OpenAIConfigError("api_key must be a non-empty string")
        if api_key is None and not is_loopback(host):
            raise OpenAIConfigError(f"host {host!r} is not loopback: give an api_key, or bind 127.0.0.1")  # fmt: skip
        if not isinstance(model_name, str) or not model_name:
            raise OpenAIConfigError("model_name must be a non-empty string")
        if max_body_bytes < 1024 or idle_timeout_s <= 0:
            raise OpenAIConfigError("max_body_bytes must be >= 1024 and idle_timeout_s > 0")
        try:
            self.codec = TextCodec.load(tokenizer_dir)
        except ValueError as exc:
            raise OpenAIConfigError(str(exc)) from None
        self.engine = engine
        self.host, self.requested_port = host, port
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.created = int(time.time())
        self.closing = threading.Event()  # set by close: waiting requests end
        self.httpd: ThreadingHTTPServer | None = None  # set by start
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve on a thread of its own. Raises ``OpenAIConfigError`` if the
        address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": family})
        try:
            httpd = server_cls((self.host, self.requested_port), Handler)
        except OSError as exc:
            raise OpenAIConfigError(f"cannot bind {self.host}:{self.requested_port}: {exc.strerror}") from None  # fmt: skip
        httpd.daemon_threads = True
        httpd.app = self  # type: ignore[attr-defined]
        self.httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="openai-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        assert self.httpd is not None, "start() first"
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving: requests in progress are cancelled and answered 503 (a stream
        ends with an error event). Idempotent; does not close the engine."""
        self.closing.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def authorized(self, header: str | None) -> bool:
        if self.api_key is None:
            return True
        want = f"Bearer {self.api_key}".encode()
        return header is not None and hmac.compare_digest(header.encode(), want)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (HTTP/1.1, kept alive)."""

    protocol_version = "HTTP/1.1"
    server_version = "tpcache"

    @property
    def app(self) -> OpenAIServer:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the endpoint's figures are the engine's; no line per request on stderr

    def do_GET(self) -> None:
        self._route(self.command)

    # every other method: 405 on a known path, else 404
    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        self.body_read = False
        try:
            if path not in PATHS:
                raise ApiError(404, f"no such path: {method} {path}", code="unknown_url")
            if PATHS[path] != method:
                raise ApiError(405, f"{path} takes {PATHS[path]}, not {method}", code="method_not_allowed")  # fmt: skip
            if path != "/health" and not self.app.authorized(self.headers.get("Authorization")):
                raise ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip
            if path == "/health":
                self._send_json(200, {"status": "ok"})
            elif path == "/v1/models":
                self._send_json(200, models_body(self.app.model_name, self.app.created))
            else:
                self._complete()
        except ApiError as exc:
            # A body left unread would be taken for the next request: the connection ends.
            unread = self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0"  # fmt: skip
            if unread and not self.body_read:
                self.close_connection = True
            self._send_json(exc.status, exc.body())

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
                    self._event(completion_body(cid, created, model, choices, None))
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
        sock = self.connection
        with contextlib.suppress(OSError, ValueError):
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
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


__all__ = ["OpenAIConfigError", "OpenAIServer"]
