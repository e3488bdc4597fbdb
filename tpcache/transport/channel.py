"""The step channel: how the coordinator reaches its ranks on every step, off the Ray RPC
path (a Ray actor call costs ~30x a bare broadcast here).

The coordinator holds the hub (``StepHub``); each rank runs a loop (``serve``),
connected once per group and generation. Ranks on the coordinator's node connect to a
Unix socket in a directory only its user can read (``unix_accept.py``: a third of ZMQ
IPC's cost per message); ranks on other nodes reach a ZMQ ROUTER over TCP, where the hub
is a CURVE server that lets in only the key pairs it made for those ranks (handed to
them through the Ray setup call, which Ray's token protects). Ray keeps placement, start,
restart, naming and the setup calls.

Messages (one frame each: a kind byte, the message's number, its parts as one msgpack
array: ``channel_msgs.pack``), each numbered by the hub (its ticket, 8 bytes) and
answered under the same number:
- hub -> rank ``STEPS [step, ...]``: encoded ``Step``s, applied in order, each with its
  own collectives (``RankWorker.apply``); ``CALL [pickle((method, args, only))]``: a
  ``RankWorker`` method, in order with the steps, on every rank or on rank ``only``
  (the others answer None); ``STOP`` (the kind alone): leave the loop.
- rank -> hub ``HELLO`` + its rank once; then one reply per message, in order:
  ``RESULTS [result, ...]``, ``REPLY [pickle(value)]`` or ``ERROR [pickle(exc)]``.
Pickle is used only between the hub and ranks it authenticated (IPC by file mode, TCP by
CURVE keys).

What a rank may make the hub hold: an answer of at most ``max_reply`` bytes
(``channel_msgs.MAX_REPLY``; the rank sends a ``ReplyTooLarge`` error in place of a larger
one); a longer frame ends its connection as its header arrives, on either path.

The hub never blocks forever: a send to a rank with ``hwm`` messages unanswered (it
stopped reading) fails after the caller's timeout, before any rank is sent the message; a
rank that is gone fails the send at once (its socket closed, or ``ROUTER_MANDATORY``); a
wait for replies ends at its timeout, when a rank's socket closes or when ``dead()``
names a rank (or raises ``ChannelError`` itself where it knows why a rank's loop ended,
e.g. the rank's ``ChannelConnectError``: the hub passes it on). Nor does it wait for a
busy rank to read: what a local rank's socket cannot take at once goes out on the hub's
writer thread (``unix_writer.py``), which cuts off a rank that has not taken a message
within the send's timeout.
"""

from __future__ import annotations

import os
import pickle
import select
import time
from collections.abc import Callable

import msgspec
import zmq

from tpcache.errors import TpcacheError
from tpcache.transport.channel_loop import RankLoop, serve
from tpcache.transport.channel_msgs import (
    CALL,
    ERROR,
    HELLO,
    MAX_REPLY,
    STEPS,
    STOP,
    UNIX,
    Attach,
    ChannelConnectError,
    ChannelError,
    ReplyTooLarge,
    pack,
    unpack,
)
from tpcache.transport.private_dir import PrivateDir, hub_dir
from tpcache.transport.tcp_link import POLLIN, TcpLinks
from tpcache.transport.unix_accept import HELLO_S, UnixLinks

# The protocol's names, for the hub's users and the ranks alike.
__all__ = [
    "CALL",
    "STEPS",
    "Attach",
    "ChannelConnectError",
    "ChannelError",
    "RankErrors",
    "RankLoop",
    "ReplyTooLarge",
    "StepHub",
    "serve",
]


class StepHub:
    """The coordinator's side: a Unix socket per rank on its node (``UnixLinks``), a
    CURVE TCP ROUTER for the others (``TcpLinks``), replies kept per rank in order.

    Messages are numbered from 0 (``send`` returns the number, the ticket); every rank
    answers each in order, and ``collect(ticket)`` takes that ticket's replies, whatever
    other tickets are out (a call may be sent while steps are in flight). Replies nobody
    collects (tickets abandoned after a failure) stay until the hub is closed, which a
    recovery does. A local connection that has not said hello within ``hello_s``
    seconds is closed (``UnixLinks``); a rank that sends an answer over ``max_reply``
    bytes is cut off before it is read. Not thread-safe.
    """

    def __init__(
        self,
        world_size: int,
        remote_ranks: set[int],
        host: str,
        hwm: int = 1000,
        hello_s: float = HELLO_S,
        max_reply: int = MAX_REPLY,
    ) -> None:
        self.world_size = world_size
        self.hwm = hwm  # messages unanswered per rank before a send waits
        self._remote = remote_ranks
        self._dir: PrivateDir | None = None
        self._replies: list[dict[int, list[bytes]]] = [{} for _ in range(world_size)]
        self._unanswered = [0] * world_size  # messages sent to each rank, not answered
        self._sent = 0
        self._hello: set[int] = set()
        # Made once (a socket's poll() builds one per call); plain poll(2) unless a ZMQ
        # socket must be polled too.
        self._poller = zmq.Poller() if remote_ranks else select.poll()
        self._tcp: TcpLinks | None = None
        self._unix: UnixLinks | None = None
        tag = os.urandom(4).hex()
        idents = {r: f"r{r}-{tag}".encode() for r in range(world_size)}
        local = {idents[r]: r for r in range(world_size) if r not in remote_ranks}
        path = ""
        try:
            if local:
                self._dir, path = hub_dir()
                pollin = POLLIN if remote_ranks else select.POLLIN
                self._unix = UnixLinks(path, local, HELLO, self._poller, pollin, hello_s, max_reply)
            if remote_ranks:
                remote = {idents[r]: r for r in remote_ranks}
                self._tcp = TcpLinks(remote, host, hwm, self._poller, max_reply)
        except BaseException:
            self.close()
            raise
        self.attach = [
            self._tcp.attach[r]
            if self._tcp is not None and r in remote_ranks
            else Attach(UNIX + path, idents[r], hwm=hwm, max_reply=max_reply)
            for r in range(world_size)
        ]

    @property
    def unix_links(self) -> UnixLinks | None:
        """The local ranks' Unix-socket side (None when every rank is remote)."""
        return self._unix

    # ---- connecting ---------------------------------------------------------------------
    def wait_connected(self, timeout: float, dead: Callable[[], int | None]) -> None:
        """Until every rank has said hello; raises ``ChannelError`` at the timeout or when
        ``dead()`` names a rank that is gone."""
        deadline = time.monotonic() + timeout
        while len(self._hello) < self.world_size:
            self._drain(min(0.05, max(0.0, deadline - time.monotonic())))
            self._check(deadline, dead, "did not connect to the step channel")

    # ---- messages -----------------------------------------------------------------------
    def send(self, kind: bytes, frames: list[bytes], timeout: float) -> int:
        """Send one message to every rank; returns its ticket. Raises ``ChannelError``
        naming a rank that is gone or has not read for ``timeout`` seconds.

        A local rank's message is queued whole: what its socket cannot take at once (a
        message larger than the socket's buffer, while the rank is busy) is written by
        the hub's writer thread, which cuts the rank off if it has not taken it within
        ``timeout``; the hub's next call then names it (``collect``, ``send``)."""
        deadline = time.monotonic() + timeout
        for r in range(self.world_size):
            self._wait_room(r, deadline, timeout)
        ticket = self._sent
        self._sent += 1
        body = pack(kind, ticket.to_bytes(8, "big"), frames)
        for r in range(self.world_size):
            if r in self._remote:
                assert self._tcp is not None
                self._tcp.send(r, body, deadline, timeout, self._drain)
            else:
                assert self._unix is not None
                self._unix.send(r, body, timeout)
            self._unanswered[r] += 1
        return ticket

    def _wait_room(self, rank: int, deadline: float, timeout: float) -> None:
        """Until ``rank`` may be sent one more message: a local one is connected, and
        each has fewer than ``hwm`` unanswered (checked for every rank before the message
        goes to any: it goes to all of them or to none). A remote rank's ZMQ queues hold
        ``hwm`` messages each way, so one with fewer unanswered has room in them."""
        while True:
            if rank not in self._remote:
                link = self._link(rank)
                if link.closed:
                    raise ChannelError(rank, link.why or "is gone", dead=True)
            if self._unanswered[rank] < self.hwm:
                return
            # A full rank may be one waiting in a collective for a peer that is gone:
            # name the gone one, not the one waiting for it.
            self._check_gone(lambda: None, -1)
            if time.monotonic() > deadline:
                raise ChannelError(rank, f"stopped reading (nothing taken in {timeout:g}s)")
            self._drain(0.01)

    def _link(self, rank: int):
        if self._unix is None or rank not in self._unix.by_rank:
            raise ChannelError(rank, "has not connected to the step channel", dead=True)
        return self._unix.by_rank[rank]

    def ready(self, ticket: int) -> bool:
        """Whether every rank has answered ``ticket`` (reads what has arrived; no wait)."""
        self._drain(0.0)
        return self._all_answered(ticket)

    def _all_answered(self, ticket: int) -> bool:
        return all(ticket in q for q in self._replies)

    def collect(
        self,
        ticket: int,
        timeout: float,
        dead: Callable[[], int | None],
        lag_s: float | None = None,
    ) -> list[list[bytes]]:
        """Every rank's reply to ``ticket``, by rank: the frames after the kind. Raises
        ``RankErrors`` with what the ranks raised for it, or ``ChannelError`` at the
        timeout, for a rank that is gone (``dead()``), or for one that has not answered
        ``lag_s`` seconds after a peer's answer was seen here."""
        deadline = time.monotonic() + timeout
        first_seen: float | None = None
        while not self._all_answered(ticket):
            self._drain(min(0.05, max(0.0, deadline - time.monotonic())))
            if self._all_answered(ticket):
                break
            if self._any_error(ticket):
                # Peers raise together: a moment more lets every rank's error arrive, so
                # the one where it failed can be named, or a rank that died (its peers'
                # collectives failed because of it) be seen as the cause.
                grace = min(deadline, time.monotonic() + 1.0)
                while not self._all_answered(ticket) and time.monotonic() < grace:
                    self._drain(0.02)
                    self._check_gone(dead, ticket)
                break
            self._check(deadline, dead, f"did not answer message {ticket}", ticket)
            if lag_s is not None and first_seen is None and self._any_answer(ticket):
                first_seen = time.monotonic()
            if first_seen is not None and time.monotonic() - first_seen > lag_s:
                late = next(r for r in range(self.world_size) if ticket not in self._replies[r])
                raise ChannelError(
                    late, f"hung: no answer to message {ticket} {lag_s:g}s after a peer's"
                )
        out: list[list[bytes]] = []
        errors: list[tuple[int, BaseException]] = []
        for r in range(self.world_size):
            frames = self._take(r, ticket)
            if frames is None:
                continue
            if frames[0] == ERROR:
                errors.append((r, pickle.loads(frames[1])))
            else:
                out.append(frames[1:])
        if errors:
            raise RankErrors(errors)
        return out

    def _any_answer(self, ticket: int) -> bool:
        return any(ticket in q for q in self._replies)

    def _any_error(self, ticket: int) -> bool:
        return any(q.get(ticket, (b"",))[0] == ERROR for q in self._replies)

    def _take(self, rank: int, ticket: int) -> list[bytes] | None:
        return self._replies[rank].pop(ticket, None)

    def _drain(self, wait_s: float) -> None:
        unix, tcp = self._unix, self._tcp
        for key, events in self._poller.poll(int(wait_s * 1000)):
            if unix is not None and unix.owns(key):
                got = unix.on_event(key, events)
            elif tcp is not None and tcp.owns(key):
                got = tcp.on_event()
            else:
                continue
            for rank, body in got:
                self._take_in(rank, body)
        if unix is not None and unix.waiting:  # a connection that has not said hello
            for rank, body in unix.expire():
                self._take_in(rank, body)

    def _take_in(self, rank: int, body: bytes) -> None:
        kind = body[:1]
        if kind == HELLO:
            self._hello.add(rank)
            return
        try:
            frames = unpack(body)
        except msgspec.DecodeError:
            return
        self._replies[rank][int.from_bytes(body[1:9], "big")] = [kind, *frames]
        self._unanswered[rank] -= 1

    def _check_gone(self, dead: Callable[[], int | None], ticket: int) -> None:
        """Raise ``ChannelError`` for a rank that is gone: named by ``dead()``, or a local
        rank whose socket closed without answering ``ticket`` (any of them, not only the
        first to close: one that answered and then closed owes nothing)."""
        gone = dead()
        if gone is not None:
            raise ChannelError(gone, "is gone (its process died)", dead=True)
        if self._unix is None:
            return
        for r, link in self._unix.by_rank.items():
            if link.closed and ticket not in self._replies[r]:
                raise ChannelError(r, link.why or "is gone (its socket closed)", dead=True)

    def _check(
        self, deadline: float, dead: Callable[[], int | None], what: str, ticket: int = -1
    ) -> None:
        self._check_gone(dead, ticket)
        if time.monotonic() >= deadline:
            late = [r for r in range(self.world_size) if ticket not in self._replies[r]]
            if ticket < 0:
                late = [r for r in range(self.world_size) if r not in self._hello]
            raise ChannelError(late[0] if late else 0, f"{what} in time")

    def stop_ranks(self) -> None:
        """Ask every connected rank to leave its loop (best effort, no wait)."""
        for r in range(self.world_size):
            if self._tcp is not None and r in self._remote:
                self._tcp.stop(r, STOP)
            elif self._unix is not None and r in self._unix.by_rank:
                self._unix.send(r, STOP, 1.0)

    def close(self) -> None:
        for links in (self._unix, self._tcp):
            if links is not None:
                links.close()
        self._unix = self._tcp = None
        if self._dir is not None:
            self._dir.remove()
            self._dir = None


class RankErrors(TpcacheError):
    """What ranks raised for one message: ``errors`` is [(rank, exception)] by rank."""

    def __init__(self, errors: list[tuple[int, BaseException]]) -> None:
        super().__init__("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in errors))
        self.errors = errors
