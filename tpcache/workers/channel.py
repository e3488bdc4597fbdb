"""The step channel: how the coordinator reaches its ranks on every step, off the Ray RPC
path (a Ray actor call costs ~30x a bare broadcast here).

One ZMQ ROUTER socket in the coordinator (``StepHub``), one DEALER in each rank
(``serve``), connected once per group and generation. Ranks on the coordinator's node
connect over IPC, to a socket file in a directory only its user can read; ranks on other
nodes over TCP, where the hub is a CURVE server that lets in only the key pairs it made
for those ranks (handed to them through the Ray setup call, which Ray's token protects).
Ray keeps placement, start, restart, naming and the setup calls.

Messages (one ZMQ frame each, after the ROUTER's identity frame: a kind byte, the
message's number, its parts as one msgpack array: ``channel_loop.pack``), each numbered
by the hub (its ticket, 8 bytes) and answered under the same number:
- hub -> rank ``STEPS [step, ...]``: encoded ``Step``s, applied in order, each with its
  own collectives (``RankWorker.apply``); ``CALL [pickle((method, args, only))]``: a
  ``RankWorker`` method, in order with the steps, on every rank or on rank ``only``
  (the others answer None); ``STOP`` (the kind alone): leave the loop.
- rank -> hub ``HELLO`` + its rank once; then one reply per message, in order:
  ``RESULTS [result, ...]``, ``REPLY [pickle(value)]`` or ``ERROR [pickle(exc)]``.
Pickle is used only between the hub and ranks it authenticated (IPC by file mode, TCP by
CURVE keys).

The hub never blocks forever: a send to a rank that stopped reading fails after the
caller's timeout; a rank that is gone fails the send at once (``ROUTER_MANDATORY``); a
wait for replies ends at its timeout or when ``dead()`` names a rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq

from tpcache.errors import TpcacheError
from tpcache.workers.channel_loop import (
    CALL,
    ERROR,
    HELLO,
    STEPS,
    STOP,
    Attach,
    ChannelError,
    RankLoop,
    pack,
    serve,
    unpack,
)
from tpcache.workers.netsec import (
    allow_clients,
    make_server,
    new_keypair,
    release_clients,
)

# Plain ints: pyzmq's enum flags cost an Enum call per use on the per-step path.
_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)
_RCVMORE, _MORE_NOBLOCK = int(zmq.RCVMORE), int(zmq.SNDMORE | zmq.NOBLOCK)

# The protocol's names, for the hub's users and the ranks alike.
__all__ = [
    "CALL",
    "STEPS",
    "Attach",
    "ChannelError",
    "RankErrors",
    "RankLoop",
    "StepHub",
    "serve",
]


class StepHub:
    """The coordinator's side: one ROUTER per kind of rank (IPC for ranks on its node,
    CURVE TCP for the others), replies kept per rank in order.

    Messages are numbered from 0 (``send`` returns the number, the ticket); every rank
    answers each in order, and ``collect(ticket)`` takes that ticket's replies, whatever
    other tickets are out (a call may be sent while steps are in flight). Replies nobody
    collects (tickets abandoned after a failure) stay until the hub is closed, which a
    recovery does. Not thread-safe.
    """

    def __init__(self, world_size: int, remote_ranks: set[int], host: str, hwm: int = 1000) -> None:
        self.world_size = world_size
        self.hwm = hwm  # messages queued per rank (here and there) before a send waits
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="tpcache-ch-")  # mode 0700
        self._sockets: dict[str, zmq.Socket] = {}
        self._zap = False
        self.attach: list[Attach] = []
        try:
            self._open(remote_ranks, host)
        except BaseException:
            self.close()
            raise
        self._rank_of = {a.identity: r for r, a in enumerate(self.attach)}
        self._sock_of = [
            self._sockets["tcp" if r in remote_ranks else "ipc"] for r in range(world_size)
        ]
        self._replies: list[dict[int, list[bytes]]] = [{} for _ in range(world_size)]
        self._poller = zmq.Poller()  # made once: a socket's poll() builds one per call
        for sock in self._sockets.values():
            self._poller.register(sock, _POLLIN)
        self._sent = 0
        self._hello: set[int] = set()

    def _open(self, remote: set[int], host: str) -> None:
        tag = os.urandom(4).hex()
        local = set(range(self.world_size)) - remote
        ipc = tcp = ""
        if local:
            sock = self._router()
            ipc = f"ipc://{self._dir}/steps.sock"
            sock.bind(ipc)
            self._sockets["ipc"] = sock
        keys: dict[int, tuple[str, str]] = {}
        server_public = None
        if remote:
            public, secret = new_keypair()
            server_public = public
            keys = {r: new_keypair() for r in remote}
            allow_clients(self._ctx, tuple(k[0] for k in keys.values()))
            self._zap = True
            sock = self._router()
            make_server(sock, secret)
            sock.bind(f"tcp://{host}:*")
            tcp = sock.get(zmq.LAST_ENDPOINT).decode()
            self._sockets["tcp"] = sock
        for r in range(self.world_size):
            ident = f"r{r}-{tag}".encode()
            if r in remote:
                self.attach.append(Attach(tcp, ident, server_public, keys[r], self.hwm))
            else:
                self.attach.append(Attach(ipc, ident, hwm=self.hwm))

    def _router(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        return sock

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
        naming a rank that is gone or has not read for ``timeout`` seconds."""
        ticket = self._sent
        self._sent += 1
        body = pack(kind, ticket.to_bytes(8, "big"), frames)
        for r in range(self.world_size):
            self._send_one(r, body, timeout)
        return ticket

    def _send_one(self, rank: int, body: bytes, timeout: float) -> None:
        sock = self._sock_of[rank]
        identity = self.attach[rank].identity
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Copied, not zero-copy: steps are small, and zero-copy sends start
                # pyzmq's garbage-collector thread, seen in a hang at interpreter exit.
                # The identity frame is where a full queue (EAGAIN) or a gone rank
                # (EHOSTUNREACH) fails, so a message is sent whole or not at all.
                sock.send(identity, _MORE_NOBLOCK)
                sock.send(body, _NOBLOCK)
                return
            except zmq.Again:  # its queue is full: it stopped reading
                if time.monotonic() > deadline:
                    raise ChannelError(
                        rank, f"stopped reading (nothing taken in {timeout:g}s)"
                    ) from None
                self._drain(0.01)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: not connected any more
                raise ChannelError(
                    rank, f"is not connected to the step channel ({exc})", dead=True
                ) from None

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
                    gone = dead()
                    if gone is not None:
                        raise ChannelError(gone, "is gone (its process died)", dead=True)
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
        for sock, _ in self._poller.poll(int(wait_s * 1000)):
            # Asked, not tried: a recv that finds nothing raises zmq.Again, and building
            # that exception cost more than a small step's reply (results/group_timings.md).
            while sock.getsockopt(_EVENTS) & _POLLIN:
                parts = [sock.recv(_NOBLOCK)]
                while sock.getsockopt(_RCVMORE):
                    parts.append(sock.recv(_NOBLOCK))
                self._take_in(parts)

    def _take_in(self, parts: list[bytes]) -> None:
        rank = self._rank_of.get(parts[0])
        if rank is None or len(parts) != 2:
            return  # not one of this generation's ranks
        body = parts[1]
        kind = body[:1]
        if kind == HELLO:
            self._hello.add(rank)
            return
        try:
            frames = unpack(body)
        except msgspec.DecodeError:
            return
        self._replies[rank][int.from_bytes(body[1:9], "big")] = [kind, *frames]

    def _check(
        self, deadline: float, dead: Callable[[], int | None], what: str, ticket: int = -1
    ) -> None:
        gone = dead()
        if gone is not None:
            raise ChannelError(gone, "is gone (its process died)", dead=True)
        if time.monotonic() >= deadline:
            late = [r for r in range(self.world_size) if ticket not in self._replies[r]]
            if ticket < 0:
                late = [r for r in range(self.world_size) if r not in self._hello]
            raise ChannelError(late[0] if late else 0, f"{what} in time")

    def stop_ranks(self) -> None:
        """Ask every connected rank to leave its loop (best effort, no wait)."""
        for r in range(self.world_size):
            with contextlib.suppress(zmq.ZMQError):
                self._sock_of[r].send_multipart([self.attach[r].identity, STOP], _NOBLOCK)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets = {}
        if self._zap:
            release_clients(self._ctx)
            self._zap = False
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class RankErrors(TpcacheError):
    """What ranks raised for one message: ``errors`` is [(rank, exception)] by rank."""

    def __init__(self, errors: list[tuple[int, BaseException]]) -> None:
        super().__init__("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in errors))
        self.errors = errors
