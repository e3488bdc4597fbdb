"""The hub's end of one local rank's Unix stream socket (``UnixLink``): what it sends
waits whole for the writer thread (``unix_writer.py``) when the socket cannot take it at
once, and what it reads comes out as whole frames (``frames.py``). Which connection is
which rank's is settled by the hub's side of the accept and hello (``unix_accept.py``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque

from tpcache.transport.frames import CHUNK, FrameReader, FrameTooLarge, frame


class UnixLink:
    """The hub's end of one rank's socket, never blocking the hub: what the socket cannot
    take at once waits in ``out`` for the hub's writer thread (``unix_writer.py``), so
    that a message is queued whole or not at all and a rank busy with a long step does
    not hold the coordinator. ``closed`` once the rank's end is gone or the writer cut it
    (``why`` says which).

    ``out``, ``closed`` and ``why`` are owned under ``lock``: the hub's thread queues and
    reads, the writer writes and cuts. Each part in ``out`` keeps the deadline (and the
    timeout it came from) of its message: a rank that has not taken a message by then
    has stopped reading. A frame from the rank over ``max_frame`` bytes cuts the link
    as its header arrives."""

    def __init__(self, sock: socket.socket, max_frame: int | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.reader = FrameReader(sock, max_frame)
        self.lock = threading.Lock()
        self.out: deque[tuple[memoryview, float, float]] = deque()
        self.closed = False
        self.why: str | None = None

    def queue(self, body: bytes, timeout: float) -> bool:
        """Send ``body`` as one frame: now as far as the socket takes it, the rest by the
        writer within ``timeout`` seconds. True if some is left for the writer."""
        deadline = time.monotonic() + timeout
        with self.lock:
            if self.closed:
                return False
            idle = not self.out
            self.out.extend((memoryview(part), deadline, timeout) for part in frame(body))
            if idle:  # (else the writer is on it: the order stays)
                self._write()
            return bool(self.out)

    def write(self, now: float) -> bool:
        """The writer's turn: write what the socket takes, and cut the link if its oldest
        message is past its deadline. True while bytes are left."""
        with self.lock:
            self._write()
            if self.out and self.out[0][1] <= now:
                timeout = self.out[0][2]
                self._gone(f"stopped reading (a message not taken in {timeout:g}s)")
                # Its stream may end inside a message: the rank's loop sees the end and
                # leaves instead of reading half of it (the hub's thread closes the fd).
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            return bool(self.out)

    def deadline(self) -> float | None:
        with self.lock:
            return self.out[0][1] if self.out else None

    def _write(self) -> None:
        out = self.out
        try:
            while out:
                part, deadline, timeout = out[0]
                sent = self.sock.send(part)
                if sent == len(part):
                    out.popleft()
                else:
                    out[0] = (part[sent:], deadline, timeout)
        except BlockingIOError:
            pass
        except OSError:  # EPIPE, ECONNRESET: the rank's end is gone
            self._gone("is gone (its socket closed)")

    def read(self, whole: bool = True) -> list[bytes]:
        """The whole frames that have arrived (none if nothing has); with ``whole``
        False, of one read at most (a hello is small: a stranger streaming bytes is not
        read on and on). A frame over the reader's ``max_frame`` cuts the link: the
        frames before it are returned, and nothing after it is read."""
        reader = self.reader
        frames: list[bytes] = []
        try:
            while True:
                n = reader.fill(socket.MSG_DONTWAIT)
                # Taken after every read, so a frame too large is refused at its header,
                # not once the rest of it has been read in.
                while (body := reader.next()) is not None:
                    frames.append(body)
                if n == 0:
                    self.gone()  # the end of the stream
                # A short read took all there was: asking again would only raise
                # BlockingIOError (poll reports what comes later).
                if n < CHUNK or not whole:
                    break
        except BlockingIOError:
            pass
        except FrameTooLarge as exc:
            self.gone(str(exc))
            # The sender sees its stream end instead of filling a buffer nobody reads.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            self.gone()
        return frames

    def gone(self, why: str = "is gone (its socket closed)") -> None:
        with self.lock:
            self._gone(why)

    def _gone(self, why: str) -> None:
        if not self.closed:
            self.closed = True
            self.why = why
        self.out.clear()

    def close(self) -> None:
        self.gone()
        self.sock.close()
