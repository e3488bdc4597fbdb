"""The step channel's path to ranks on other nodes: a ZMQ ROUTER over TCP that is a
CURVE server, letting in only the key pairs it made for those ranks (handed to them
through the Ray setup call, which Ray's token protects). Each rank runs a DEALER.

What a peer can make the hub hold: a frame over ``max_reply`` bytes (the largest answer a
rank sends: ``channel_msgs.MAX_REPLY``) ends its connection as its header arrives, before
it is buffered, whoever sent it: a peer without a rank's key pair never gets further than
one frame of the handshake, and a rank has at most ``hwm`` answers owed (``StepHub``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import zmq

from tpcache.transport.channel_msgs import MAX_REPLY, Attach, ChannelError
from tpcache.transport.netsec import (
    allow_clients,
    limit_receive,
    make_server,
    new_keypair,
    release_clients,
)

# Plain ints: pyzmq's enum flags cost an Enum call per use on the per-step path.
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_EVENTS, _NOBLOCK = int(zmq.EVENTS), int(zmq.NOBLOCK)
_RCVMORE, _MORE_NOBLOCK = int(zmq.RCVMORE), int(zmq.SNDMORE | zmq.NOBLOCK)


class TcpLinks:
    """The hub's side of every remote rank: one ROUTER at ``host`` (a free port), one key
    pair per rank in ``identities`` (identity -> rank); ``attach`` says how each joins.
    A rank's answers are at most ``max_reply`` bytes each (it is told so in ``attach``)."""

    def __init__(
        self,
        identities: dict[bytes, int],
        host: str,
        hwm: int,
        poller,
        max_reply: int = MAX_REPLY,
    ) -> None:
        self.identities = identities
        self._ctx = zmq.Context()
        self._zap = False
        self.sock: zmq.Socket | None = None
        try:
            public, secret = new_keypair()
            keys = {r: new_keypair() for r in identities.values()}
            allow_clients(self._ctx, tuple(k[0] for k in keys.values()))
            self._zap = True
            sock = self.sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, hwm)
            # A rank answers each message once and is sent no more while it owes ``hwm``
            # answers: with its hello, no more can be waiting from it.
            limit_receive(sock, max_reply, hwm + 1)
            make_server(sock, secret)
            sock.bind(f"tcp://{host}:*")
            endpoint = sock.get(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self.close()
            raise
        self.attach = {
            r: Attach(endpoint, ident, public, keys[r], hwm, max_reply)
            for ident, r in identities.items()
        }
        poller.register(sock, POLLIN)

    def owns(self, key: object) -> bool:
        return key is self.sock

    def send(
        self, rank: int, body: bytes, deadline: float, timeout: float, drain: Callable
    ) -> None:
        """Send ``body`` whole or not at all; waits (``drain``ing replies) while the rank's
        queue is full, up to ``deadline``."""
        assert self.sock is not None
        sock, identity = self.sock, self.attach[rank].identity
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
                drain(0.01)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: not connected any more
                raise ChannelError(
                    rank, f"is not connected to the step channel ({exc})", dead=True
                ) from None

    def on_event(self) -> list[tuple[int, bytes]]:
        """(rank, body) of every message a known rank sent that has arrived."""
        sock = self.sock
        assert sock is not None
        got = []
        # Asked, not tried: a recv that finds nothing raises zmq.Again, and building that
        # exception cost more than a small step's reply (results/group_timings.md).
        while sock.getsockopt(_EVENTS) & POLLIN:
            parts = [sock.recv(_NOBLOCK)]
            while sock.getsockopt(_RCVMORE):
                parts.append(sock.recv(_NOBLOCK))
            rank = self.identities.get(parts[0])
            if rank is not None and len(parts) == 2:  # else not one of this generation's
                got.append((rank, parts[1]))
        return got

    def stop(self, rank: int, body: bytes) -> None:
        if self.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([self.attach[rank].identity, body], _NOBLOCK)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self._zap:
            release_clients(self._ctx)
            self._zap = False
        self._ctx.term()
