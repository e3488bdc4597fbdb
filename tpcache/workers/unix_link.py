"""The step channel's path to ranks on the coordinator's node: one Unix stream socket per
rank, each message a length-prefixed frame.

Why not ZMQ IPC (what this path was first): on the 2-core machine a 200-byte broadcast
to 2 processes with an answer from each takes 139 us and 147 us of CPU over ZMQ IPC, and
41 us and 47 us over Unix sockets (``scripts/bench_links.py``, load average 4.9): ZMQ
hands every message to an I/O thread on each side, two more wake-ups per direction,
which is most of a small step's cost. A Unix socket wakes the blocked reader directly.

The socket lives in the hub's directory (mode 0700): only the user that runs the ranks
can connect, and a connection counts only once it names an identity the hub made.
"""

from __future__ import annotations

import socket
from collections import deque

_HEADER = 8  # a frame's length, little-endian
_CHUNK = 1 << 18  # bytes read per recv
_COPY_BELOW = 1 << 16  # frames this small go out in one buffer with their header


def frame(body: bytes) -> list[bytes]:
    """The buffers that send ``body`` as one frame (its header, then it)."""
    head = len(body).to_bytes(_HEADER, "little")
    return [head + body] if len(body) < _COPY_BELOW else [head, body]


class FrameReader:
    """Whole frames out of the bytes a stream socket delivers, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts in _buf
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)

    def fill(self, flags: int = 0) -> int:
        """Read what has arrived (blocks unless ``flags`` say not to); the bytes read, 0
        at the end of the stream. Raises ``BlockingIOError`` when nothing waits and it
        must not block, ``OSError`` for a reset connection."""
        n = self.sock.recv_into(self._chunk, _CHUNK, flags)
        self._buf += self._view[:n]
        return n

    def next(self) -> bytes | None:
        """The next whole frame's body, or None until more arrives."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEADER:
            return None
        end = pos + _HEADER + int.from_bytes(buf[pos : pos + _HEADER], "little")
        if len(buf) < end:
            return None
        body = bytes(buf[pos + _HEADER : end])
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end > _CHUNK:  # drop what was read, now and then (amortised O(1) a byte)
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        return body


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send ``body`` as one frame on a blocking socket (the rank's side)."""
    for part in frame(body):
        sock.sendall(part)


class UnixLink:
    """The hub's end of one rank's socket, never blocking: what cannot be written at once
    waits in ``out`` for ``flush`` (called again when the socket can take more), so that a
    message is queued whole or not at all; ``closed`` once the rank's end is gone."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.reader = FrameReader(sock)
        self.out: deque[memoryview] = deque()
        self.closed = False

    def queue(self, body: bytes) -> None:
        """Send ``body`` as one frame: now as far as the socket takes it, later the rest."""
        self.out.extend(memoryview(part) for part in frame(body))
        self.flush()

    def flush(self) -> None:
        out = self.out
        try:
            while out:
                sent = self.sock.send(out[0])
                if sent == len(out[0]):
                    out.popleft()
                else:
                    out[0] = out[0][sent:]
        except BlockingIOError:
            pass
        except OSError:  # EPIPE, ECONNRESET: the rank's end is gone
            self.gone()

    def read(self) -> list[bytes]:
        """The whole frames that have arrived (none if nothing has)."""
        reader = self.reader
        try:
            # A short read took all there was: asking again would only raise
            # BlockingIOError (poll reports what comes later).
            while (n := reader.fill(socket.MSG_DONTWAIT)) == _CHUNK:
                pass
            if n == 0:
                self.gone()  # the end of the stream
        except BlockingIOError:
            pass
        except OSError:
            self.gone()
        frames = []
        while (body := reader.next()) is not None:
            frames.append(body)
        return frames

    def gone(self) -> None:
        self.closed = True
        self.out.clear()

    def close(self) -> None:
        self.gone()
        self.sock.close()


class UnixLinks:
    """The hub's side of every local rank: a listening socket at ``path`` and, once a
    connection names one of ``identities`` in its first frame (``hello`` + identity), that
    rank's link. Registers its sockets in ``poller`` (``select.poll`` or ``zmq.Poller``,
    whose flags ``pollin``/``pollout`` are) and is driven by the hub's poll loop."""

    def __init__(
        self, path: str, identities: dict[bytes, int], hello: bytes, poller, flags: tuple[int, int]
    ) -> None:
        self.path = path
        self.identities = identities
        self.hello = hello
        self.poller = poller
        self.pollin, self.pollout = flags
        self.by_rank: dict[int, UnixLink] = {}
        self._by_fd: dict[int, UnixLink] = {}
        self._rank_of: dict[int, int] = {}  # fd -> rank, once it said hello
        self._wants_out: set[int] = set()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(max(1, len(identities)))
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self.listener = listener
        poller.register(listener.fileno(), self.pollin)

    def owns(self, fd: object) -> bool:
        return fd == self.listener.fileno() or fd in self._by_fd

    def on_event(self, fd: int, events: int) -> list[tuple[int, bytes]]:
        """Handle what ``poll`` reported for ``fd``: (rank, body) of each whole frame a
        known rank sent, after its hello."""
        if fd == self.listener.fileno():
            self._accept()
            return []
        link = self._by_fd[fd]
        if events & self.pollout:
            link.flush()
        got = []
        for body in link.read() if events & ~self.pollout else ():
            rank = self._rank_of.get(fd)
            if rank is not None:
                got.append((rank, body))
            elif (
                body[: len(self.hello)] == self.hello and body[len(self.hello) :] in self.identities
            ):
                rank = self.identities[body[len(self.hello) :]]
                self._rank_of[fd] = rank
                self.by_rank[rank] = link
                got.append((rank, self.hello))
            else:  # not one of this generation's ranks
                link.gone()
                break
        self.watch(link)
        return got

    def send(self, rank: int, body: bytes) -> None:
        link = self.by_rank[rank]
        link.queue(body)
        self.watch(link)

    def unsent(self) -> int | None:
        """A rank whose link still holds bytes it could not write yet, if any."""
        return next((r for r, link in self.by_rank.items() if link.out), None)

    def drop(self, rank: int) -> None:
        """Close ``rank``'s link (its stream may end inside a message: it cannot be used
        again, and the rank's loop sees the end and leaves)."""
        link = self.by_rank[rank]
        link.gone()
        self.watch(link)
        link.close()

    def watch(self, link: UnixLink) -> None:
        """Poll ``link`` for room to write while it has bytes waiting; forget it once gone."""
        fd = link.fd
        if link.closed:
            if fd in self._by_fd:
                self.poller.unregister(fd)
                del self._by_fd[fd]
                self._wants_out.discard(fd)
            return
        wants = bool(link.out)
        if wants != (fd in self._wants_out):
            self.poller.modify(fd, self.pollin | (self.pollout if wants else 0))
            (self._wants_out.add if wants else self._wants_out.discard)(fd)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            link = UnixLink(sock)
            self._by_fd[link.fd] = link
            self.poller.register(link.fd, self.pollin)

    def close(self) -> None:
        for link in [*self._by_fd.values(), *self.by_rank.values()]:
            link.close()
        self._by_fd.clear()
        self.listener.close()
