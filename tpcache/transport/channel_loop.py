"""A rank's side of the step channel (``channel.py`` has the protocol and the hub): the
loop that applies the hub's messages in order and answers each under its ticket, over
the rank's Unix socket here, or over TCP (``rank_tcp.py``) from another node. The
messages and errors it shares with the hub are ``channel_msgs.py``'s.
"""

from __future__ import annotations

import pickle
import select
import socket
import threading
import time
from typing import Any

from tpcache.transport.channel_msgs import (
    CALL,
    CONNECT_S,
    ERROR,
    HELLO,
    REPLY,
    RESULTS,
    STEPS,
    STOP,
    UNIX,
    Attach,
    BadChannelMessage,
    ChannelConnectError,
    ReplyTooLarge,
    pack,
    unpack,
)
from tpcache.transport.frames import FrameReader, LinkConfigError, send_frame
from tpcache.transport.rank_tcp import serve_tcp


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
    try:
        return serve_tcp(
            rank,
            attach,
            lambda body: _answer(worker, body, loop, attach.max_reply),
            loop.stop,
            poll_s,
            connect_s,
        )
    finally:
        loop.done.set()


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
