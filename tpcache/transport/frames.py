"""Length-prefixed frames over a stream socket: how a message is cut for the wire, and
how whole ones are read back out of what arrives. Both ends of a rank's Unix socket use
these (the hub's ``unix_link.UnixLink``, the rank's ``channel_loop``), and so do the
errors of a link's frames and settings.

A reader never holds more than one frame of its ``max_frame`` bytes: a longer one is
refused as its header arrives (``FrameTooLarge``), before its body is read.
"""

from __future__ import annotations

import socket

from tpcache.errors import TpcacheError

HEADER = 8  # a frame's length, little-endian
CHUNK = 1 << 18  # bytes read per recv
COPY_BELOW = 1 << 16  # frames this small go out in one buffer with their header


def frame(body: bytes) -> list[bytes]:
    """The buffers that send ``body`` as one frame (its header, then it)."""
    head = len(body).to_bytes(HEADER, "little")
    return [head + body] if len(body) < COPY_BELOW else [head, body]


class LinkConfigError(TpcacheError, ValueError):
    """A link's own setting (a wait in seconds) is invalid; the message names it."""


class FrameTooLarge(TpcacheError, ValueError):
    """A frame's header declares more bytes than the reader takes; its body is not read."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"sent a frame of {size:,} bytes, over the limit of {limit:,}")
        self.size = size
        self.limit = limit


class FrameReader:
    """Whole frames out of the bytes a stream socket delivers, in order; with
    ``max_frame``, none longer than that (``next`` raises ``FrameTooLarge`` as soon as
    such a frame's header has arrived, so at most a read's worth of it is held)."""

    def __init__(self, sock: socket.socket, max_frame: int | None = None) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts in _buf
        self._chunk = bytearray(CHUNK)
        self._view = memoryview(self._chunk)

    def fill(self, flags: int = 0) -> int:
        """Read what has arrived (blocks unless ``flags`` say not to); the bytes read, 0
        at the end of the stream. Raises ``BlockingIOError`` when nothing waits and it
        must not block, ``OSError`` for a reset connection."""
        n = self.sock.recv_into(self._chunk, CHUNK, flags)
        self._buf += self._view[:n]
        return n

    @property
    def held(self) -> int:
        """The bytes this reader holds: unread ones, and taken frames not yet dropped."""
        return len(self._buf)

    def next_size(self) -> int | None:
        """The length the next frame's header declares, once the header has arrived."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < HEADER:
            return None
        return int.from_bytes(buf[pos : pos + HEADER], "little")

    def next(self) -> bytes | None:
        """The next whole frame's body, or None until more arrives. Raises
        ``FrameTooLarge`` (and keeps raising it) if its header declares more than
        ``max_frame`` bytes."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < HEADER:
            return None
        size = int.from_bytes(buf[pos : pos + HEADER], "little")
        if self.max_frame is not None and size > self.max_frame:
            raise FrameTooLarge(size, self.max_frame)
        end = pos + HEADER + size
        if len(buf) < end:
            return None
        body = bytes(buf[pos + HEADER : end])
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end > CHUNK:  # drop what was read, now and then (amortised O(1) a byte)
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        return body


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send ``body`` as one frame on a blocking socket (the rank's side)."""
    for part in frame(body):
        sock.sendall(part)
