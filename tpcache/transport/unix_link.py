"""The step channel's path to ranks on the coordinator's node: one Unix stream socket per
rank, each message a length-prefixed frame.

Why not ZMQ IPC (what this path was first): on the 2-core machine a 200-byte broadcast
to 2 processes with an answer from each takes 139 us and 147 us of CPU over ZMQ IPC, and
41 us and 47 us over Unix sockets (``scripts/bench_links.py``, load average 4.9): ZMQ
hands every message to an I/O thread on each side, two more wake-ups per direction,
which is most of a small step's cost. A Unix socket wakes the blocked reader directly.

The socket lives in the hub's directory (mode 0700): only the user that runs the ranks
can connect, and a connection counts only once it names an identity the hub made. One
that does not (a stray or stuck local client) is not kept: a wrong first frame closes it
at once, silence closes it after ``HELLO_S``, and no more than ``SPARE_HELLOS`` beyond
one per rank wait at a time, so such clients cannot pile up the hub's descriptors. Nor
can a connection make the hub hold more than one frame of ``max_frame`` bytes: a longer
one is refused as its header arrives (``FrameTooLarge``), before its body is read.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque

from tpcache.errors import TpcacheError
from tpcache.transport.unix_writer import LinkWriter

_HEADER = 8  # a frame's length, little-endian
_CHUNK = 1 << 18  # bytes read per recv
_COPY_BELOW = 1 << 16  # frames this small go out in one buffer with their header
# How long a connection has to say hello before the hub closes it. A rank sends its hello
# in the same breath as its connect (``channel_loop._serve_unix``), so it is there when
# the hub accepts it or milliseconds later; 5 s covers a rank descheduled between the two
# on a loaded host many times over, and still lets a stray or stuck client go soon.
HELLO_S = 5.0
# Connections let wait for their hello beyond one per local rank. A hub polls only while
# its coordinator works, so the time limit alone would not bound what strays hold while
# it is idle; past this the oldest goes (after a last look for its hello: a rank's is
# there at once, so the oldest waiting is the likeliest stray).
SPARE_HELLOS = 16


def frame(body: bytes) -> list[bytes]:
    """The buffers that send ``body`` as one frame (its header, then it)."""
    head = len(body).to_bytes(_HEADER, "little")
    return [head + body] if len(body) < _COPY_BELOW else [head, body]


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
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)

    def fill(self, flags: int = 0) -> int:
        """Read what has arrived (blocks unless ``flags`` say not to); the bytes read, 0
        at the end of the stream. Raises ``BlockingIOError`` when nothing waits and it
        must not block, ``OSError`` for a reset connection."""
        n = self.sock.recv_into(self._chunk, _CHUNK, flags)
        self._buf += self._view[:n]
        return n

    def next_size(self) -> int | None:
        """The length the next frame's header declares, once the header has arrived."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEADER:
            return None
        return int.from_bytes(buf[pos : pos + _HEADER], "little")

    def next(self) -> bytes | None:
        """The next whole frame's body, or None until more arrives. Raises
        ``FrameTooLarge`` (and keeps raising it) if its header declares more than
        ``max_frame`` bytes."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEADER:
            return None
        size = int.from_bytes(buf[pos : pos + _HEADER], "little")
        if self.max_frame is not None and size > self.max_frame:
            raise FrameTooLarge(size, self.max_frame)
        end = pos + _HEADER + size
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
                if n < _CHUNK or not whole:
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


class UnixLinks:
    """The hub's side of every local rank: a listening socket at ``path`` and, once a
    connection names one of ``identities`` in its first frame (``hello`` + identity), that
    rank's link. Registers its sockets for reading in ``poller`` (``select.poll`` or
    ``zmq.Poller``, whose flag ``pollin`` is) and is driven by the hub's poll loop; what a
    socket cannot take at once goes out on the writer thread (``LinkWriter``).

    A connection has ``hello_s`` seconds from its accept to say hello: the hub's poll
    loop calls ``expire`` while any waits (``waiting``), which closes the late ones.
    A rank's frame over ``max_frame`` bytes (None: no limit) cuts its link, unread (its
    ``why`` says so). Nothing here blocks on a peer. Raises ``ValueError`` for
    ``hello_s`` not > 0."""

    def __init__(
        self,
        path: str,
        identities: dict[bytes, int],
        hello: bytes,
        poller,
        pollin: int,
        hello_s: float = HELLO_S,
        max_frame: int | None = None,
    ) -> None:
        if not 0 < hello_s < float("inf"):
            raise LinkConfigError(f"hello_s must be seconds > 0, got {hello_s!r}")
        self.path = path
        self.identities = identities
        self.hello = hello
        self.hello_s = hello_s
        self.max_frame = max_frame
        self.poller = poller
        self.pollin = pollin
        self.by_rank: dict[int, UnixLink] = {}
        self._by_fd: dict[int, UnixLink] = {}
        self._rank_of: dict[int, int] = {}  # fd -> rank, once it said hello
        # fd -> the time its hello is due, oldest first (accept order). Owned by the hub's
        # thread, as are the maps above.
        self.waiting: dict[int, float] = {}
        self._max_waiting = len(identities) + SPARE_HELLOS
        self._max_hello = len(hello) + max(map(len, identities), default=0)
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
        self.writer = LinkWriter()

    def owns(self, fd: object) -> bool:
        return fd == self.listener.fileno() or fd in self._by_fd

    def on_event(self, fd: int, events: int) -> list[tuple[int, bytes]]:
        """Handle what ``poll`` reported for ``fd``: (rank, body) of each whole frame a
        known rank sent, after its hello (``hello`` itself for the hello)."""
        if fd == self.listener.fileno():
            return self._accept()
        link = self._by_fd[fd]
        rank = self._rank_of.get(fd)
        if rank is None:
            return self._hello_of(link)
        got = [(rank, body) for body in link.read()]
        self._forget_if_closed(link)
        return got

    def expire(self) -> list[tuple[int, bytes]]:
        """Close the connections whose hello is overdue (each looked at once more first:
        what it says, as ``on_event``, if it has just said hello)."""
        now = time.monotonic()
        got: list[tuple[int, bytes]] = []
        while self.waiting:
            fd, due = next(iter(self.waiting.items()))
            if due > now:
                break
            got += self._settle(self._by_fd[fd])
        return got

    def _hello_of(self, link: UnixLink) -> list[tuple[int, bytes]]:
        """Read a connection that has not said hello: make it its rank's link if its
        first frame is a hello with one of ``identities``, close it if that frame is
        anything else (or its header is longer than any hello), else let it wait."""
        frames = link.read(whole=False)
        if not frames:
            size = link.reader.next_size()
            if link.closed or (size is not None and size > self._max_hello):
                self._drop(link)
            return []
        first, n = frames[0], len(self.hello)
        rank = self.identities.get(first[n:]) if first[:n] == self.hello else None
        if rank is None:  # not one of this generation's ranks
            self._drop(link)
            return []
        fd = link.fd
        del self.waiting[fd]
        self._rank_of[fd] = rank
        self.by_rank[rank] = link
        self._forget_if_closed(link)
        return [(rank, self.hello)] + [(rank, body) for body in frames[1:]]

    def _settle(self, link: UnixLink) -> list[tuple[int, bytes]]:
        """A waiting connection's last chance: its hello if it has come, else closed."""
        got = self._hello_of(link)
        if link.fd in self.waiting:
            self._drop(link)
        return got

    def _drop(self, link: UnixLink) -> None:
        self.waiting.pop(link.fd, None)
        link.gone("never said hello")
        self._forget_if_closed(link)  # (out of the poller before its fd is closed)
        link.sock.close()

    def send(self, rank: int, body: bytes, timeout: float) -> None:
        """Queue ``body`` for ``rank``: written now as far as its socket takes it, the rest
        by the writer, which cuts the link if the rank has not taken it in ``timeout``
        seconds (the hub then names the rank at its next call)."""
        link = self.by_rank[rank]
        if link.queue(body, timeout):
            self.writer.want(link)
        self._forget_if_closed(link)

    def _forget_if_closed(self, link: UnixLink) -> None:
        fd = link.fd
        if link.closed and fd in self._by_fd:
            self.poller.unregister(fd)
            del self._by_fd[fd]

    def _accept(self) -> list[tuple[int, bytes]]:
        got: list[tuple[int, bytes]] = []
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return got
            link = UnixLink(sock, self.max_frame)
            self._by_fd[link.fd] = link
            self.waiting[link.fd] = time.monotonic() + self.hello_s
            self.poller.register(link.fd, self.pollin)
            if len(self.waiting) > self._max_waiting:
                got += self._settle(self._by_fd[next(iter(self.waiting))])

    def close(self) -> None:
        self.writer.close()  # first: it may still write to the sockets closed below
        for link in [*self._by_fd.values(), *self.by_rank.values()]:
            link.close()
        self._by_fd.clear()
        self.waiting.clear()
        self.listener.close()
