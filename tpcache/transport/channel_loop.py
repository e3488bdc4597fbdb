"""A rank's side of the step channel (``channel.py`` has the protocol and the hub): the
DEALER loop that applies the hub's messages in order and answers each under its ticket.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tpcache.errors import TpcacheError
from tpcache.transport.frames import FrameReader, LinkConfigError, send_frame
from tpcache.transport.netsec import make_client

STEPS, CALL, STOP = b"S", b"C", b"X"
HELLO, RESULTS, REPLY, ERROR = b"H", b"R", b"P", b"E"
UNIX = "unix://"  # the endpoint of a rank on the hub's node: its socket's path follows
_HEARTBEAT_MS = 1000  # a TCP rank's ZMTP ping interval; 5 missed: its hub is gone
# How long a rank may take to reach its hub. The hub listens before any rank is told
# where, so a connect on a working node or network takes a round trip and a CURVE
# handshake (milliseconds); 10 s is that many times over on a loaded host, with ZMQ's
# reconnects (every 0.1 s) retried ~100 times, and well under the coordinator's wait for
# its ranks (120 s by default), so the rank's reason arrives there before that times out.
CONNECT_S = 10.0
# The largest reply a rank sends its hub, and so the most one connection can make the hub
# hold at a time (its TCP socket's MAXMSGSIZE, its Unix reader's frame limit). A reply is
# a step's results (a few dozen bytes an op), a call's return value or an error; the only
# large ones are a forward's logits, float32 rows x vocabulary: 256 MiB holds one row for
# each of 512 requests over a 131,072-token vocabulary (a decode batch of a Llama 3
# model), or every row of a 2,048-token prefill over a 32,000-token one. A rank refuses
# to send more (``ReplyTooLarge``, raised to the caller) rather than be cut off.
MAX_REPLY = 256 << 20

_encode_frames = msgspec.msgpack.Encoder().encode
_decode_frames = msgspec.msgpack.Decoder(list[bytes]).decode


def pack(kind: bytes, number: bytes, frames: list[bytes]) -> bytes:
    """One message's body: its kind (1 byte), its number (8), its frames (one msgpack
    array of bin). One ZMQ frame instead of one per part: pyzmq's multipart calls cost
    more than a small step's cache work, on both sides."""
    return kind + number + _encode_frames(frames)


def unpack(body: bytes) -> list[bytes]:
    """The frames of a body ``pack`` made (its kind is ``body[:1]``, its number
    ``body[1:9]``). Raises ``msgspec.DecodeError`` for a body it did not make."""
    return _decode_frames(memoryview(body)[9:])


class BadChannelMessage(TpcacheError, ValueError):
    """A channel message of a kind, or naming a method, that the rank does not serve."""


class ChannelError(TpcacheError, RuntimeError):
    """A rank did not answer, stopped reading, or is gone; ``rank`` names it."""

    def __init__(self, rank: int, message: str, dead: bool = False) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.dead = dead


class ChannelConnectError(ChannelError):
    """A rank could not reach its hub: ``endpoint`` is where it tried, ``reason`` what
    the OS (or ZMQ) said. Its loop ends with this error, which the coordinator reports
    as the rank's reason; a rank whose hub goes after a good connect leaves quietly.
    Not ``dead``: its process lives. It crosses Ray as the loop's error (pickled whole,
    as every ``TpcacheError`` is)."""

    def __init__(self, rank: int, endpoint: str, reason: str) -> None:
        super().__init__(rank, f"could not connect to the step channel at {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason


class ReplyTooLarge(TpcacheError, ValueError):
    """A rank's answer to a message is larger than the step channel carries
    (``Attach.max_reply``); the rank sent this error instead, and goes on."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(
            f"the answer to {what} is {size:,} bytes, over the step channel's limit of "
            f"{limit:,}: for a forward, ask for fewer logit rows (the last of each request, "
            f"not every one) or a shorter chunk"
        )
        self.size = size
        self.limit = limit


@dataclass(frozen=True)
class Attach:
    """What one rank needs to join the channel (sent through the Ray setup call)."""

    endpoint: str
    identity: bytes
    server_key: str | None = None  # the hub's CURVE public key (TCP only)
    keypair: tuple[str, str] | None = None  # this rank's CURVE (public, secret)
    hwm: int = 1000  # messages queued at the rank before the hub's sends wait
    max_reply: int = MAX_REPLY  # bytes of one answer, the most the hub reads (MAX_REPLY)


class RankLoop:
    """A rank's side of the channel: its state, shared with the rank's other threads.

    ``busy_since`` is the time the command in hand started (None while waiting): a rank
    whose loop has been busy much longer than a step takes is hung. ``stop`` asks the
    loop to leave (it checks between messages, at least every ``poll_s``)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.done = threading.Event()
        self.busy_since: float | None = None

    def busy_s(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since


def serve(
    worker: Any,
    rank: int,
    attach: Attach,
    loop: RankLoop,
    poll_s: float = 0.1,
    connect_s: float = CONNECT_S,
) -> int:
    """Run the channel loop of ``worker`` (a ``RankWorker``) until ``STOP``, ``loop.stop``
    or the hub's end is gone; returns the number of messages handled. Errors a message
    raises go back to the hub. ``attach.endpoint``: ``unix://`` a rank on the hub's node,
    ``tcp://`` one on another node.

    Raises ``ChannelConnectError`` (``loop.done`` set) if the hub cannot be reached: the
    connect fails, or is not made (TCP: not through the CURVE handshake) within
    ``connect_s`` seconds. Raises ``ValueError`` for a ``connect_s`` that is not > 0."""
    if not connect_s > 0 or connect_s == float("inf"):
        raise LinkConfigError(f"connect_s must be seconds > 0, got {connect_s!r}")
    if attach.endpoint.startswith(UNIX):
        return _serve_unix(worker, rank, attach, loop, poll_s, connect_s)
    return _serve_zmq(worker, rank, attach, loop, poll_s, connect_s)


def _answer(worker: Any, body: bytes, loop: RankLoop, max_reply: int) -> bytes:
    """The reply body to the message ``body``: a ``ReplyTooLarge`` error in place of one
    over ``max_reply`` bytes (the hub would drop the connection it came on)."""
    loop.busy_since = time.monotonic()
    try:
        out, reply = _run(worker, body[:1], body)
    finally:
        loop.busy_since = None
    packed = pack(out, body[1:9], reply)
    if len(packed) > max_reply:
        too_large = ReplyTooLarge(_what(body), len(packed), max_reply)
        packed = pack(ERROR, body[1:9], [_pickled(too_large)])
    return packed


def _what(body: bytes) -> str:
    """What the message ``body`` asked for, in words (for an error)."""
    number = int.from_bytes(body[1:9], "big")
    if body[:1] == CALL:
        return f"message {number} ({pickle.loads(unpack(body)[0])[0]})"
    return f"message {number} (steps)"


def _connect_unix(sock: socket.socket, rank: int, endpoint: str, connect_s: float) -> None:
    """Connect ``sock`` to the hub at ``endpoint``, or raise ``ChannelConnectError``."""
    deadline = time.monotonic() + connect_s
    sock.setblocking(False)
    while True:
        try:
            sock.connect(endpoint[len(UNIX) :])
            break
        except BlockingIOError:
            # The hub's queue of connections not yet accepted is full: wait for a place
            # (as a blocking connect would, but not for ever: the hub may never take it).
            if time.monotonic() >= deadline:
                why = f"not accepted within {connect_s:g}s (the hub's queue stayed full)"
                raise ChannelConnectError(rank, endpoint, why) from None
            time.sleep(0.01)
        except OSError as exc:  # no such path, refused, a path too long
            raise ChannelConnectError(rank, endpoint, f"{type(exc).__name__}: {exc}") from None
    sock.setblocking(True)


def _serve_unix(
    worker: Any, rank: int, attach: Attach, loop: RankLoop, poll_s: float, connect_s: float
) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handled = 0
    try:
        _connect_unix(sock, rank, attach.endpoint, connect_s)
        send_frame(sock, HELLO + attach.identity)
        reader = FrameReader(sock)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        wait_ms = int(poll_s * 1000)
        while not loop.stop.is_set():
            body = reader.next()
            if body is None:
                # The wait is bounded so that ``loop.stop`` is seen; what has arrived is
                # read whole (the hub writes a message at once or not at all).
                if poller.poll(wait_ms) and not reader.fill():
                    break  # the hub is gone
                continue
            if body[:1] == STOP:
                break
            send_frame(sock, _answer(worker, body, loop, attach.max_reply))
            handled += 1
    except OSError:  # after a good connect: the hub's end is gone (reset, broken pipe)
        pass
    finally:
        sock.close()
        loop.done.set()
    return handled


# What a TCP rank's monitor reports: the handshake done (connected), the connection gone,
# and why a connect has not been made yet (for the error, if it never is).
_MONITOR = int(
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class _Connect:
    """A TCP rank's connect, as its monitor tells it: ``up`` once the handshake is done,
    ``gone`` once the connection it made is lost; ``why`` says what went wrong so far."""

    def __init__(self) -> None:
        self.up = False
        self.gone = False
        self.retries = 0
        self.why = "no answer (the connect was neither made nor refused)"

    def take(self, monitor: zmq.Socket) -> None:
        """Read the events that have arrived."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
            elif kind == zmq.EVENT_DISCONNECTED:
                # Before the handshake, ZMQ retries (a failed handshake said why already).
                self.gone = self.up
                if self.why.startswith("no answer"):
                    self.why = "the connection closed before the handshake"
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self.retries += 1
                self.why = f"{self.retries} connect attempt(s) failed (refused or unreachable)"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.why = f"the hub refused this rank's key (CURVE handshake, status {value})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.why = f"the handshake failed (ZMTP protocol error {value:#x})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.why = f"the handshake failed ({os.strerror(value)})"


def _serve_zmq(
    worker: Any, rank: int, attach: Attach, loop: RankLoop, poll_s: float, connect_s: float
) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor: zmq.Socket | None = None
    handled = 0
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, attach.identity)
        sock.setsockopt(zmq.RCVHWM, attach.hwm)
        if attach.server_key is not None:
            make_client(sock, attach.server_key, attach.keypair)
        # ZMTP heartbeats (answered by ZMQ's I/O thread, also while a step runs): a hub
        # whose node went silent ends the connection as a closed one would.
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * _HEARTBEAT_MS)
        # A DEALER reconnects on its own and tells no one its peer left, nor that it
        # never reached it: the monitor does, so the loop leaves when the hub's end is
        # gone, as the Unix loop does (its hub may have closed without a STOP reaching
        # this rank), and fails when the hub is not reached in time.
        monitor = sock.get_monitor_socket(_MONITOR)
        try:
            sock.connect(attach.endpoint)
        except zmq.ZMQError as exc:  # an endpoint ZMQ cannot use
            raise ChannelConnectError(rank, attach.endpoint, f"ZMQError: {exc}") from None
        sock.send(HELLO + str(rank).encode())
        poller = zmq.Poller()  # made once: a socket's poll() builds one per call
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        wait_ms = int(poll_s * 1000)
        link = _Connect()
        deadline = time.monotonic() + connect_s
        while not loop.stop.is_set():
            ready = dict(poller.poll(wait_ms))
            if monitor in ready:
                link.take(monitor)
                if link.gone:
                    break  # disconnected after a good connect: the hub's end is gone
            if sock not in ready:
                if not link.up and time.monotonic() > deadline:
                    raise ChannelConnectError(
                        rank, attach.endpoint, f"not connected within {connect_s:g}s: {link.why}"
                    )
                continue
            link.up = True  # a message came: the handshake is done, seen or not
            body = sock.recv()
            if body[:1] == STOP:
                break
            sock.send(_answer(worker, body, loop, attach.max_reply))
            handled += 1
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
        loop.done.set()
    return handled


def _run(worker: Any, kind: bytes, body: bytes) -> tuple[bytes, list[bytes]]:
    """What to answer to the message ``body`` (of ``kind``): a kind and its frames."""
    try:
        if kind == STEPS:
            return RESULTS, worker.apply_steps(unpack(body))
        if kind == CALL:
            method, args, only = pickle.loads(unpack(body)[0])
            if method.startswith("_"):
                raise BadChannelMessage(f"{method!r} is not a public RankWorker method")
            if only is not None and only != worker.rank:
                return REPLY, [pickle.dumps(None)]
            return REPLY, [pickle.dumps(getattr(worker, method)(*args))]
        raise BadChannelMessage(f"unknown message kind {kind!r}")
    except Exception as exc:  # the hub re-raises it, typed
        return ERROR, [_pickled(exc)]


def _pickled(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
