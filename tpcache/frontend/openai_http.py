"""An OpenAI-compatible HTTP endpoint over the serving engine: ``POST /v1/completions``
(plain or streamed as server-sent events), ``GET /v1/models``, ``GET /health``. The
standard library's threading HTTP server, one thread per connection (no dependency
beyond ``tokenizers`` for text); what a request may hold is in ``openai_records``, how
text and stop strings go in ``openai_text``.

Extensions to OpenAI's completion API: each choice carries ``token_ids``, the tokens it
generated (in a streamed chunk, the chunk's new ones), so a client without the model's
tokenizer can read the output; without a tokenizer ``text`` is "". ``finish_reason`` is
``cancelled`` for a request the engine cancelled (the server closing). ``usage`` has
``prompt_tokens_details.cached_tokens``, the prompt tokens the prefix cache held.

A client that goes away (its socket reads end-of-file while it waits, a streamed write
fails, or its socket blocks for a minute) has its engine requests cancelled, so their
slots come back at once. How a connection is served: ``openai_handler``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from tpcache.errors import TpcacheError
from tpcache.frontend.openai_handler import Handler, Served
from tpcache.frontend.openai_records import error_body
from tpcache.frontend.openai_text import TextCodec
from tpcache.logs import Throttle
from tpcache.transport.netsec import is_loopback

MAX_BODY_BYTES = 16 << 20
logger = logging.getLogger("tpcache.frontend")
_BUSY_BODY = json.dumps(error_body("the server has all the connections it takes; try again", "server_error", None, "busy")).encode()  # fmt: skip
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class OpenAIConfigError(TpcacheError, ValueError):
    """An ``OpenAIServer`` that may not be built as asked (its message says why)."""


class HttpServer(ThreadingHTTPServer):
    """The threading server with a bound on connections served at once (each holds a
    thread): one more is answered 503 and closed at once. Quiet about clients that
    reset their connection (a pool closing a kept-alive one): nothing went wrong here."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], max_connections: int) -> None:
        super().__init__(address, Handler)
        self.max_connections = max_connections
        self.active = 0  # connections being served (under _lock)
        self._lock = threading.Lock()
        # The operator's lines on refused clients (busy here, 401 in the handler).
        self.refusals = Throttle(logger)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            busy = self.active >= self.max_connections
            self.active += not busy
        if busy:
            self.refusals.warning(
                "busy",
                f"OpenAI endpoint refused a connection from {client_address[0]}: it serves "
                f"{self.max_connections} already (answered 503)",
            )
            with contextlib.suppress(OSError):
                request.sendall(BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self.active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class OpenAIServer:
    """The endpoint over ``engine`` (a started ``tpcache.engine.Engine``, which the
    caller keeps and closes). Serves the model as ``model_name``; text prompts and stop
    strings need ``tokenizer_dir`` to hold a ``tokenizer.json``.

    Binds ``host`` (loopback by default) on ``port`` (0: any free one) at ``start()``.
    A host that is not loopback must have ``api_key``: every call but ``/health`` must
    then carry ``Authorization: Bearer <api_key>``; without one the constructor raises
    ``OpenAIConfigError``, as it does for a ``tokenizer.json`` that does not load. A
    request body over ``max_body_bytes`` is refused (413) before it is read. A request
    whose engine sends nothing for ``idle_timeout_s`` is cancelled (504). At most
    ``max_connections`` connections are served at once (one thread each, a kept-alive
    one until it has been idle a minute); one more is answered 503 ``busy``."""

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
        max_connections: int = 256,
    ) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise OpenAIConfigError("api_key must be a non-empty string")
        if api_key is None and not is_loopback(host):
            raise OpenAIConfigError(f"host {host!r} is not loopback: give an api_key, or bind 127.0.0.1")  # fmt: skip
        if not isinstance(model_name, str) or not model_name:
            raise OpenAIConfigError("model_name must be a non-empty string")
        if max_body_bytes < 1024 or idle_timeout_s <= 0 or max_connections < 1:
            raise OpenAIConfigError("max_body_bytes must be >= 1024, idle_timeout_s > 0 and max_connections >= 1")  # fmt: skip
        try:
            codec = TextCodec.load(tokenizer_dir)
        except ValueError as exc:
            raise OpenAIConfigError(str(exc)) from None
        self.served = Served(
            engine, codec, model_name, api_key, max_body_bytes, idle_timeout_s,
            created=int(time.time()), closing=threading.Event(),
        )  # fmt: skip
        self.host, self.requested_port = host, port
        self.max_connections = max_connections
        self.port = 0  # the bound port, set by start
        self.httpd: ThreadingHTTPServer | None = None  # set by start, cleared by close

    def start(self) -> None:
        """Bind and serve on a thread of its own. Raises ``OpenAIConfigError`` if the
        address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_cls = type("HttpServer", (HttpServer,), {"address_family": family})
        try:
            httpd = server_cls((self.host, self.requested_port), self.max_connections)
        except OSError as exc:
            raise OpenAIConfigError(f"cannot bind {self.host}:{self.requested_port}: {exc.strerror}") from None  # fmt: skip
        httpd.served = self.served  # type: ignore[attr-defined]
        self.httpd = httpd
        self.port = int(httpd.server_address[1])
        threading.Thread(target=httpd.serve_forever, name="openai-http", daemon=True).start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving: requests in progress are cancelled and answered 503 (a stream
        ends with an error event). Idempotent; does not close the engine."""
        self.served.closing.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


__all__ = ["OpenAIConfigError", "OpenAIServer"]
