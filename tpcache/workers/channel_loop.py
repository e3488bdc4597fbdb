"""A rank's side of the step channel (``channel.py`` has the protocol and the hub): the
DEALER loop that applies the hub's messages in order and answers each under its ticket.
"""

from __future__ import annotations

import pickle
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from tpcache.errors import TpcacheError
from tpcache.workers.netsec import make_client
from tpcache.workers.unix_link import FrameReader, send_frame

STEPS, CALL, STOP = b"S", b"C", b"X"
HELLO, RESULTS, REPLY, ERROR = b"H", b"R", b"P", b"E"
UNIX = "unix://"  # the endpoint of a rank on the hub's node: its socket's path follows
_HEARTBEAT_MS = 1000  # a TCP rank's ZMTP ping interval; 5 missed: its hub is gone

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


class ChannelError(TpcacheError, RuntimeError):
    """A rank did not answer, stopped reading, or is gone; ``rank`` names it."""

    def __init__(self, rank: int, message: str, dead: bool = False) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.dead = dead


@dataclass(frozen=True)
class Attach:
    """What one rank needs to join the channel (sent through the Ray setup call)."""

    endpoint: str
    identity: bytes
    server_key: str | None = None  # the hub's CURVE public key (TCP only)
    keypair: tuple[str, str] | None = None  # this rank's CURVE (public, secret)
    hwm: int = 1000  # messages queued at the rank before the hub's sends wait


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


def serve(worker: Any, rank: int, attach: Attach, loop: RankLoop, poll_s: float = 0.1) -> int:
    """Run the channel loop of ``worker`` (a ``RankWorker``) until ``STOP``, ``loop.stop``
    or the hub's end is gone; returns the number of messages handled. Errors a message
    raises go back to the hub. ``attach.endpoint``: ``unix://`` a rank on the hub's node,
    ``tcp://`` one on another node."""
    if attach.endpoint.startswith(UNIX):
        return _serve_unix(worker, rank, attach, loop, poll_s)
    return _serve_zmq(worker, rank, attach, loop, poll_s)


def _answer(worker: Any, body: bytes, loop: RankLoop) -> bytes:
    """The reply body to the message ``body``."""
    loop.busy_since = time.monotonic()
    try:
        out, reply = _run(worker, body[:1], body)
    finally:
        loop.busy_since = None
    return pack(out, body[1:9], reply)


def _serve_unix(worker: Any, rank: int, attach: Attach, loop: RankLoop, poll_s: float) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handled = 0
    try:
        sock.connect(attach.endpoint[len(UNIX) :])
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
            send_frame(sock, _answer(worker, body, loop))
            handled += 1
    except OSError:  # the hub's end is gone (reset, or a broken pipe on a reply)
        pass
    finally:
        sock.close()
        loop.done.set()
    return handled


def _serve_zmq(worker: Any, rank: int, attach: Attach, loop: RankLoop, poll_s: float) -> int:
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
        # A DEALER reconnects on its own and tells no one its peer left: the monitor
        # does, so the loop leaves when the hub's end is gone, as the Unix loop does
        # (its hub may have closed without a STOP reaching this rank).
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(attach.endpoint)
        sock.send(HELLO + str(rank).encode())
        poller = zmq.Poller()  # made once: a socket's poll() builds one per call
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        wait_ms = int(poll_s * 1000)
        while not loop.stop.is_set():
            ready = poller.poll(wait_ms)
            if not ready:
                continue
            if len(ready) > 1 or ready[0][0] is monitor:
                break  # disconnected: the hub's end is gone
            body = sock.recv()
            if body[:1] == STOP:
                break
            sock.send(_answer(worker, body, loop))
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
                raise ValueError(f"{method!r} is not a public RankWorker method")
            if only is not None and only != worker.rank:
                return REPLY, [pickle.dumps(None)]
            return REPLY, [pickle.dumps(getattr(worker, method)(*args))]
        raise ValueError(f"unknown message kind {kind!r}")
    except Exception as exc:  # the hub re-raises it, typed
        return ERROR, [_pickled(exc)]


def _pickled(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
