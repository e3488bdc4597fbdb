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

import socket
import time

from tpcache.transport.frames import LinkConfigError
from tpcache.transport.unix_link import UnixLink
from tpcache.transport.unix_writer import LinkWriter

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
