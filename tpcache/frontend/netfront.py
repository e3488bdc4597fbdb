"""The frontend API over the network, for routers that are not Ray drivers: the msgspec
calls on a ZMQ ROUTER socket (TCP or IPC), served by one thread next to the coordinator.

Wire (the client is a DEALER; ``tpcache.client`` is one in Python):
- request ``[id, token, body]``: ``id`` 8 bytes the client picks (echoed back), ``token``
  the shared token or empty, ``body`` a msgpack list of calls (``api.Call``): the calls
  of one request are applied in order, in one step;
- reply ``[id, body]``: a msgpack list of replies (``api.Reply``), one per call.

Every request that is waiting when the thread gets to work is applied in the same step,
whoever sent it: many clients share the cost of a step. At most ``max_queue`` calls wait;
a request beyond that is answered at once with ``ErrorReply("Busy", retryable=True)``.
A message larger than any valid request is refused before it is decoded.

Who may connect: loopback or IPC by default. On a network address the socket is a CURVE
server (``curve_secret_key``, optionally only ``curve_client_keys``) or requests must
carry ``token``, or ``insecure=True`` says anyone who reaches it may drive the cache.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from tpcache.errors import TpcacheError
from tpcache.frontend.api import (
    BadRequest,
    Call,
    ErrorReply,
    Reply,
    decode_calls,
    encode_replies,
)
from tpcache.workers.netsec import (
    NetSecError,
    allow_clients,
    check_key,
    endpoint_is_local,
    make_server,
    release_clients,
)


class FrontendConfigError(TpcacheError, ValueError):
    """A field of ``FrontendConfig`` is invalid; the message names it."""


@dataclass(frozen=True)
class FrontendConfig:
    """Where the network frontend listens and who may use it (validated here)."""

    endpoint: str = "tcp://127.0.0.1:5560"
    curve_secret_key: str | None = None
    curve_client_keys: tuple[str, ...] = ()
    token: str | None = None  # a shared secret every request carries
    insecure: bool = False  # a network address without CURVE or a token, on purpose
    max_queue: int = 4096  # calls waiting; more get a Busy reply

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise FrontendConfigError(
                f"endpoint must be 'transport://address', got {self.endpoint!r}"
            )
        try:
            if self.curve_secret_key is not None:
                check_key("curve_secret_key", self.curve_secret_key)
            for key in self.curve_client_keys:
                check_key("a key of curve_client_keys", key)
        except NetSecError as exc:
            raise FrontendConfigError(str(exc)) from None
        if self.curve_client_keys and self.curve_secret_key is None:
            raise FrontendConfigError("curve_client_keys need curve_secret_key")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise FrontendConfigError("token must be a str of at least 16 characters")
        if (
            isinstance(self.max_queue, bool)
            or not isinstance(self.max_queue, int)
            or self.max_queue < 1
        ):
            raise FrontendConfigError(f"max_queue must be an int >= 1, got {self.max_queue!r}")
        guarded = self.curve_secret_key is not None or self.token is not None
        if not (endpoint_is_local(self.endpoint) or guarded or self.insecure):
            raise FrontendConfigError(
                f"{self.endpoint!r} is reachable from the network and the API carries prompts "
                "and changes the cache: give curve_secret_key or token, or insecure=True"
            )


Runner = Callable[[list[list[Call]]], list[list[Reply]]]


class NetFrontend:
    """Serves ``run`` (one step for a list of requests' calls; the caller's lock and
    coordinator inside) on ``config.endpoint``; ``idle`` runs when no request came for
    50 ms (the coordinator's waiting steps must not wait for the next request). Bound in the constructor (a taken or bad
    address raises ``FrontendConfigError`` at once); ``close()`` stops it."""

    def __init__(
        self,
        config: FrontendConfig,
        run: Runner,
        max_bytes: int,
        idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self._run = run
        self._idle = idle  # called when no request came for a while (to flush steps)
        self._max_bytes = max_bytes
        self._ctx = zmq.Context()
        self._zap = False
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if config.curve_client_keys:
                allow_clients(self._ctx, config.curve_client_keys)
                self._zap = True
            if config.curve_secret_key is not None:
                make_server(self._sock, config.curve_secret_key)
            self._sock.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._shut()
            raise FrontendConfigError(f"cannot listen on {config.endpoint!r}: {exc}") from None
        self.endpoint: str = self._sock.get(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        # Counters, written by the serving thread only.
        self.requests = 0
        self.steps = 0
        self.busy = 0
        self.refused = 0  # bad token or malformed
        self._thread = threading.Thread(target=self._serve, name="tpcache-frontend", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (the request in hand finishes first). Idempotent."""
        self._stop.set()
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._shut()

    def _shut(self) -> None:
        self._sock.close(linger=0)
        if self._zap:
            release_clients(self._ctx)
            self._zap = False
        self._ctx.term()

    # ---- the serving thread -------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                self._idle()
                continue
            batch: list[tuple[list[bytes], list[Call]]] = []
            waiting = 0
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = self._take(frames, waiting)
                if got is not None:
                    batch.append(got)
                    waiting += len(got[1])
            if batch:
                replies = self._run([calls for _, calls in batch])
                self.steps += 1
                for (head, _), out in zip(batch, replies, strict=True):
                    self._reply(head, out)

    def _take(self, frames: list[bytes], waiting: int) -> tuple[list[bytes], list[Call]] | None:
        """A request's (reply head, calls), or None when it was answered here (bad token,
        malformed, no room)."""
        if len(frames) != 4 or len(frames[1]) != 8:
            self.refused += 1
            return None  # not this protocol: no reply (there is no id to answer to)
        self.requests += 1
        head = frames[:2]
        want = self.config.token
        if want is not None and not hmac.compare_digest(frames[2], want.encode()):
            self.refused += 1
            self._reply(head, [ErrorReply("Unauthenticated", "a valid token is required")])
            return None
        try:
            calls = decode_calls(frames[3], self._max_bytes)
        except BadRequest as exc:
            self.refused += 1
            self._reply(head, [ErrorReply("BadRequest", str(exc))])
            return None
        if waiting + len(calls) > self.config.max_queue:
            self.busy += 1
            err = ErrorReply("Busy", f"more than {self.config.max_queue} calls waiting", True)
            self._reply(head, [err] * len(calls))
            return None
        return head, calls

    def _reply(self, head: list[bytes], replies: list[Reply]) -> None:
        # A client that is gone (or not reading) has no one to take its reply.
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([*head, encode_replies(replies)], zmq.NOBLOCK)


__all__ = ["FrontendConfig", "FrontendConfigError", "NetFrontend"]
