"""The frontend API over the network, for routers that are not Ray drivers: the msgspec
calls on a ZMQ ROUTER socket (TCP or IPC), served by one thread next to the coordinator.

Wire (the client is a DEALER; ``tpcache.client`` is one in Python):
- request ``[id, token, body]``: ``id`` 8 bytes the client picks (echoed back), ``token``
  the shared token, a tenant's token, or empty, ``body`` a msgpack list of calls
  (``api.Call``): the calls of one request are applied in order, in one step;
- reply ``[id, body]``: a msgpack list of replies (``api.Reply``), one per call.

Every request that is waiting when the thread gets to work is applied in the same step,
whoever sent it: many clients share the cost of a step. At most ``max_queue`` calls wait;
a request beyond that is answered at once with ``ErrorReply("Busy", retryable=True)``.

Limits on what a client can make the server hold: ZMQ drops a connection that sends a
frame larger than any valid request (``MAXMSGSIZE``) before buffering it; at most
``RCVHWM`` requests wait per connection; a request of more than three frames is read
one frame at a time and thrown away.

Who a client is (``owners``): its credential (a tenant's token, a CURVE key where
``curve_client_keys`` are set) and its connection's routing id. Request ids are scoped to
it: another client's ids are unknown to it. ``tpcache.client`` sets a random 16-byte
routing id, which no other client can guess; a client that leaves it to ZMQ gets a short
one that another client of the same credential could claim once it has disconnected.
A client's ``stats`` are its own figures and the group's health.

Retries: a request that reaches the server a second time (the same routing id, id and
body: a client that timed out and sends it again) is not applied again; the reply it
got is sent again, for the last ``REPLAY_LIMIT`` requests applied.

Who may connect: loopback or IPC by default. On a network address the socket is a CURVE
server (``curve_secret_key``, optionally only ``curve_client_keys``) or requests must
carry ``token`` or a token of ``tenants``, or ``insecure=True`` says anyone who reaches
it may drive the cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from tpcache.frontend.api import (
    BadRequest,
    Call,
    ErrorReply,
    Reply,
    decode_calls,
    encode_replies,
)
from tpcache.frontend.net_config import FrontendConfig, FrontendConfigError
from tpcache.frontend.netgen import GenerateEngine, NetGenerate, engine_calls
from tpcache.frontend.owners import Owner
from tpcache.frontend.recent import RecentReplies, request_key
from tpcache.logs import Throttle, one_line
from tpcache.transport.netsec import allow_clients, make_server, release_clients

Runner = Callable[[list[tuple[Owner, list[Call]]]], list[list[Reply]]]

# Requests waiting per connection inside ZMQ (beyond it the client's sends wait): with
# MAXMSGSIZE, what one connection can make the server hold.
RCVHWM = 32
# A request has three frames after the routing id; a longer one is thrown away.
FRAMES = 4

logger = logging.getLogger("tpcache.frontend")


class NetFrontend:
    """Serves ``run`` (one step for a list of requests' calls, each with its owner; the
    caller's lock and coordinator inside) on ``config.endpoint``; ``idle`` runs when no
    request came for 50 ms (the coordinator's waiting steps must not wait for the next
    request). Generate and cancel calls go to ``engine`` (``netgen``; None: answered
    ``NoModel``), whose events this thread sends on. Bound in the constructor (a taken
    or bad address raises ``FrontendConfigError`` at once); ``close()`` stops it."""

    def __init__(
        self,
        config: FrontendConfig,
        run: Runner,
        max_bytes: int,
        idle: Callable[[], None] = lambda: None,
        engine: GenerateEngine | None = None,
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
            # No frame of a valid request is larger than its body (a token is short).
            self._sock.setsockopt(zmq.MAXMSGSIZE, max(max_bytes, 4096))
            self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
            # A client that went away without closing is noticed, so its routing id is
            # free again for its reconnect (the server keeps the first connection of an id).
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
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
        self._replies = RecentReplies()  # the serving thread's only
        # The serving thread's only; as many generate calls run as calls may wait.
        self.generate = NetGenerate(engine, self._send, config.max_queue)
        # Counters, written by the serving thread only.
        self.requests = 0
        self.steps = 0
        self.busy = 0
        self.refused = 0  # bad token or malformed
        self.resent = 0  # requests answered again from RecentReplies
        self._refusals = Throttle(logger)  # a line per kind of refusal, 10 s apart at most
        self._thread = threading.Thread(target=self._serve, name="tpcache-frontend", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (the request in hand finishes first) and cancel the generate
        calls still running. Idempotent."""
        self._stop.set()
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.generate.close()
            self._shut()

    def _shut(self) -> None:
        self._sock.close(linger=0)
        if self._zap:
            release_clients(self._ctx)
            self._zap = False
        self._ctx.term()

    # ---- the serving thread -------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.generate.fd, zmq.POLLIN)
        quiet_since = time.monotonic()  # the last request, or the last idle call
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self.generate.fd in ready:
                self.generate.drain()
            if self._sock not in ready:
                # Every 50 ms without a request, however often the engine's events come.
                if time.monotonic() - quiet_since >= 0.05:
                    self._idle()
                    quiet_since = time.monotonic()
                continue
            quiet_since = time.monotonic()
            batch: list[_Request] = []
            again: list[tuple[list[bytes], bytes]] = []  # repeats of a request in ``batch``
            keys: dict[bytes, int] = {}
            waiting = 0
            while True:
                got = self._recv()
                if got is None:
                    break
                req = self._take(*got, waiting=waiting)
                if req is None:
                    continue
                if engine_calls(req.calls):  # answered as the engine's events come
                    if replies := self.generate.take(req.owner, req.head, req.calls):
                        self._reply(req.head, replies)
                    continue
                if req.key in keys:  # sent again before the first was applied
                    again.append((req.head, req.key))
                    continue
                keys[req.key] = len(batch)
                batch.append(req)
                waiting += len(req.calls)
            if batch:
                replies = self._run([(r.owner, r.calls) for r in batch])
                self.steps += 1
                for req, out in zip(batch, replies, strict=True):
                    body = encode_replies(out)
                    self._replies.keep(req.key, body)
                    self._send(req.head, body)
                for head, key in again:
                    self.resent += 1
                    self._send(head, self._replies.get(key) or b"")

    def _recv(self) -> tuple[list[bytes], str, str] | None:
        """The next message's first ``FRAMES`` frames, the CURVE key it came with (""
        without client keys) and the address of its peer ("" where ZMQ does not say), or
        None when none waits. Frames beyond those are read and dropped one by one, so a
        message of many frames is never held whole."""
        try:
            first = self._sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        user = peer = ""
        if self._zap:
            with contextlib.suppress(zmq.ZMQError, KeyError):
                user = first.get("User-Id") or ""
        with contextlib.suppress(zmq.ZMQError, KeyError):  # a TCP peer's address
            peer = first.get("Peer-Address") or ""
        frames = [first.bytes]
        while self._sock.getsockopt(zmq.RCVMORE):
            part = self._sock.recv()
            if len(frames) <= FRAMES:
                frames.append(part)
        return frames, user, peer

    def _take(self, frames: list[bytes], user: str, peer: str, waiting: int) -> _Request | None:
        """A request to apply, or None when it was answered here (bad token, malformed,
        no room, or applied already: its reply is sent again)."""
        if len(frames) != FRAMES or len(frames[1]) != 8:
            self.refused += 1
            self._refused(
                "protocol", frames[0], peer,
                f"not tpcache's network protocol ({len(frames) - 1} frames, an id of "
                f"{len(frames[1]) if len(frames) > 1 else 0} bytes); not answered",
            )  # fmt: skip
            return None  # not this protocol: no reply (there is no id to answer to)
        self.requests += 1
        head = frames[:2]
        credential = self.config.credential(frames[2])
        if credential is None:
            self.refused += 1
            self._refused("token", frames[0], peer, "no valid token (answered Unauthenticated)")
            self._reply(head, [ErrorReply("Unauthenticated", "a valid token is required")])
            return None
        if not credential and user:
            credential = f"curve:{user}"
        owner = owner_of(credential, frames[0])
        key = request_key(owner, frames[1], frames[3])
        done = self._replies.get(key)
        if done is not None:
            self.resent += 1
            self._send(head, done)
            return None
        try:
            calls = decode_calls(frames[3], self._max_bytes)
        except BadRequest as exc:
            self.refused += 1
            self._refused("malformed", frames[0], peer, f"a malformed request: {one_line(exc)}")
            self._reply(head, [ErrorReply("BadRequest", str(exc))])
            return None
        if waiting + len(calls) > self.config.max_queue:
            self.busy += 1
            self._refused(
                "busy", frames[0], peer,
                f"busy: more than {self.config.max_queue} calls waiting (answered Busy, retryable)",
            )  # fmt: skip
            err = ErrorReply("Busy", f"more than {self.config.max_queue} calls waiting", True)
            self._reply(head, [err] * len(calls))
            return None
        return _Request(head, owner, calls, key)

    def _refused(self, kind: str, routing_id: bytes, peer: str, what: str) -> None:
        """The operator's line on a refused request (one per ``kind`` every 10 s at most:
        a client can send as many as it likes)."""
        who = f"{peer}, " if peer else ""
        self._refusals.warning(
            kind,
            f"network frontend {self.endpoint} refused a client ({who}connection "
            f"{routing_id[:16].hex()}): {what}",
        )

    def _reply(self, head: list[bytes], replies: list[Reply]) -> None:
        self._send(head, encode_replies(replies))

    def _send(self, head: list[bytes], body: bytes) -> bool:
        """Whether ZMQ took it: not for a client that is gone or not reading (its send
        queue is full), who has no one to take its reply."""
        try:
            self._sock.send_multipart([*head, body], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True


@dataclass
class _Request:
    head: list[bytes]  # routing id and request id: what the reply is sent back with
    owner: Owner
    calls: list[Call]
    key: bytes  # request_key: the same for the same request sent again


def owner_of(credential: str, routing_id: bytes) -> Owner:
    """The owner of a request sent with ``credential`` (``FrontendConfig.credential``)
    from the connection with ``routing_id`` (a ``tpcache.client.NetworkClient``'s ``session``)."""
    c = credential.encode("utf-8", "surrogatepass")
    return Owner(len(c).to_bytes(2, "big") + c + routing_id, credential)


__all__ = ["FrontendConfig", "FrontendConfigError", "NetFrontend", "owner_of"]
