"""What one peer can make a tpcache server hold: a message longer than the largest valid
one is refused as its header arrives, before the server buffers it, and the server goes
on serving the others.

Each test starts a message whose header declares more than the socket's limit and streams
part of it (``STREAMED``, far more than ``HELD_MAX``), from a raw socket of this process,
which holds none of it (one 1 MiB buffer sent again and again). The server runs in this
process too, so its memory is this process's resident set (``/proc/self/status``):
without the limit the server holds what was streamed. Loopback and Unix sockets only;
every wait is bounded.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Callable

import pytest
import zmq
from channel_helpers import EchoWorker, expected, run_rank

from tpcache.cache.events import AllBlocksCleared
from tpcache.events.publisher import EventConfig, EventPublisher
from tpcache.transport.channel import CALL, STEPS, ChannelError, RankErrors, StepHub
from tpcache.transport.channel_msgs import HELLO, MAX_REPLY, ReplyTooLarge
from tpcache.transport.frames import send_frame

LOOPBACK = "tcp://127.0.0.1:*"
CLAIMED = 512 << 20  # what the message's header says: over every limit tested here
STREAMED = 160 << 20  # what is sent of it before the client stops
HELD_MAX = 48 << 20  # what the server may grow by meanwhile
CHUNK = bytes(1 << 20)
WAIT_S = 10.0


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Flood:
    """A raw client on its own thread: on its connected ``sock``, sends ``opening`` (a
    greeting, a frame's header), then streams zeros until ``STREAMED`` bytes are out or
    the server ends the connection. Keeps the connection open until ``close`` (what a
    server buffered of an unfinished message stays buffered until then)."""

    def __init__(self, sock: socket.socket, opening: bytes) -> None:
        self.sock = sock
        self.sock.settimeout(WAIT_S)
        self.sent = 0
        self.cut: OSError | None = None  # how the server ended it, if it did
        self._opening = opening
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sock.sendall(self._opening)
            while self.sent < STREAMED:
                self.sock.sendall(CHUNK)
                self.sent += len(CHUNK)
        except OSError as exc:  # reset, broken pipe: the server refused the message
            self.cut = exc

    def wait(self, drive: Callable[[], object] = lambda: None) -> None:
        """Until the stream has ended, calling ``drive`` meanwhile (a server that reads
        only when asked: the hub)."""
        deadline = time.monotonic() + 2 * WAIT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            drive()
            self.thread.join(0.01)
        assert not self.thread.is_alive(), "the client's stream neither ended nor was cut"
        for _ in range(20):  # what the server took last settles (bounded)
            drive()
            time.sleep(0.01)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(WAIT_S)


def held_while(flood: Flood, before: int, drive: Callable[[], object] = lambda: None) -> int:
    flood.wait(drive)
    return rss() - before


def refused_whole(endpoint: str, kind: bytes) -> None:
    """A ``kind`` peer (NULL security) declaring a ``CLAIMED`` frame to the publisher at
    ``endpoint`` is cut off at the header, and this process does not grow by it."""
    before = rss()
    opening = greeting(b"NULL") + ready(kind) + long_frame(CLAIMED)
    flood = Flood(tcp_connect(endpoint), opening)
    try:
        held = held_while(flood, before)
        assert held < HELD_MAX, f"the publisher grew by {held:,} bytes"
        assert flood.cut is not None, f"{flood.sent:,} bytes were taken in"
    finally:
        flood.close()


# ---- ZMTP 3.0 (rfc.zeromq.org/spec/23), written out so the test needs no ZMQ client -----
def greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


def ready(socket_type: bytes) -> bytes:
    """A NULL handshake's READY command, as a client of ``socket_type`` sends it."""
    name, prop = b"Socket-Type", socket_type
    body = b"\x05READY" + bytes([len(name)]) + name + len(prop).to_bytes(4, "big") + prop
    return b"\x04" + bytes([len(body)]) + body


def long_frame(size: int, command: bool = False) -> bytes:
    """The header of a frame of ``size`` bytes (its body follows)."""
    return bytes([0x06 if command else 0x02]) + size.to_bytes(8, "big")


def tcp_connect(endpoint: str) -> socket.socket:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def test_the_replay_socket_refuses_a_request_longer_than_a_request() -> None:
    """Every replay request is 8 bytes: a client that starts sending 512 MB is cut off at
    the frame's header, the publisher does not grow, and a replay still works."""
    with (
        EventPublisher(EventConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)) as pub,
        zmq.Context() as ctx,
    ):
        pub.publish([AllBlocksCleared()])
        assert pub.replay_endpoint is not None
        refused_whole(pub.replay_endpoint, b"DEALER")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        replies = []
        while not replies or replies[-1][1] != (-1).to_bytes(8, "big", signed=True):
            assert dealer.poll(int(WAIT_S * 1000)), "no replay after the refused client"
            replies.append(dealer.recv_multipart())
        assert [int.from_bytes(m[1], "big", signed=True) for m in replies] == [0, -1]
        dealer.close()


def test_the_events_socket_refuses_a_subscription_longer_than_its_topic() -> None:
    """A PUB socket reads nothing but subscriptions: one of 512 MB is cut off at its
    header, and a subscriber still gets the stream."""
    with EventPublisher(EventConfig(endpoint=LOOPBACK, topic="kv")) as pub, zmq.Context() as ctx:
        refused_whole(pub.endpoint, b"SUB")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        deadline = time.monotonic() + WAIT_S
        while not sub.poll(20):
            assert time.monotonic() < deadline, "no events after the refused client"
            pub.publish([])
        assert sub.recv_multipart()[0] == b"kv"
        sub.close()


def never_dead() -> None:
    return None


def test_the_step_channel_tcp_socket_refuses_a_frame_over_the_largest_answer() -> None:
    """A peer without a rank's key pair gets no further than the CURVE handshake, and
    its first frame is held to the largest answer a rank sends: one declaring 512 MB is
    cut off at its header. The rank then connects and is answered."""
    assert CLAIMED > MAX_REPLY
    hub = StepHub(1, {0}, "127.0.0.1")
    loops = []
    try:
        before = rss()
        opening = greeting(b"CURVE") + long_frame(CLAIMED, command=True)
        flood = Flood(tcp_connect(hub.attach[0].endpoint), opening)
        try:
            held = held_while(flood, before, lambda: hub.ready(-1))
            assert held < HELD_MAX, f"the hub grew by {held:,} bytes"
            assert flood.cut is not None, f"{flood.sent:,} bytes were taken in"
        finally:
            flood.close()
        loops.append(run_rank(0, hub.attach[0]))
        hub.wait_connected(WAIT_S, never_dead)
        t = hub.send(STEPS, [b"after"], WAIT_S)
        assert hub.collect(t, WAIT_S, never_dead) == [[expected(b"after")]]
    finally:
        hub.stop_ranks()
        for th, loop in loops:
            loop.stop.set()
            th.join(WAIT_S)
        hub.close()


def test_the_step_channel_unix_socket_cuts_off_a_rank_sending_more_than_an_answer() -> None:
    """A local connection that said hello as rank 0 and then starts a 512 MB frame is cut
    off at the frame's header: the hub does not read it in, and names rank 0 and why,
    while rank 1 answered as usual."""
    hub = StepHub(2, set(), "")
    loops = [run_rank(1, hub.attach[1])]
    path = hub.attach[0].endpoint.removeprefix("unix://")
    flood: Flood | None = None
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(path)
        send_frame(raw, HELLO + hub.attach[0].identity)
        hub.wait_connected(WAIT_S, never_dead)
        t = hub.send(STEPS, [b"step"], WAIT_S)
        before = rss()
        # On the connection that said hello: a frame's header (its length), then zeros.
        flood = Flood(raw, CLAIMED.to_bytes(8, "little"))
        held = held_while(flood, before, lambda: hub.ready(t))
        assert held < HELD_MAX, f"the hub grew by {held:,} bytes"
        assert flood.cut is not None, f"{flood.sent:,} bytes were taken in"
        with pytest.raises(ChannelError, match=f"{CLAIMED:,} bytes, over the limit") as cut:
            hub.collect(t, WAIT_S, never_dead)
        assert cut.value.rank == 0 and cut.value.dead
    finally:
        if flood is not None:
            flood.close()
        hub.stop_ranks()
        for th, loop in loops:
            loop.stop.set()
            th.join(WAIT_S)
        hub.close()


class BigWorker(EchoWorker):
    def blob(self, n: int) -> bytes:
        return bytes(n)


def test_a_rank_sends_an_error_in_place_of_an_answer_over_the_limit() -> None:
    """A rank whose answer would be over the hub's limit sends ``ReplyTooLarge`` (the
    limit and the size in it) instead, on both paths, and both go on."""
    limit = 64 << 10
    hub = StepHub(2, {1}, "127.0.0.1", max_reply=limit)
    assert [a.max_reply for a in hub.attach] == [limit, limit]
    loops = [run_rank(r, hub.attach[r], worker=BigWorker(r)) for r in range(2)]
    try:
        hub.wait_connected(WAIT_S, never_dead)
        t = hub.send(CALL, [pickle.dumps(("blob", (limit,), None))], WAIT_S)
        with pytest.raises(RankErrors) as caught:
            hub.collect(t, WAIT_S, never_dead)
        assert [(r, type(e)) for r, e in caught.value.errors] == [
            (0, ReplyTooLarge),
            (1, ReplyTooLarge),
        ]
        err = caught.value.errors[0][1]
        assert isinstance(err, ReplyTooLarge) and err.limit == limit and err.size > limit
        assert "(blob)" in str(err) and f"limit of {limit:,}" in str(err)
        t = hub.send(CALL, [pickle.dumps(("blob", (limit - 1024,), None))], WAIT_S)
        got = [pickle.loads(f[0]) for f in hub.collect(t, WAIT_S, never_dead)]
        assert got == [bytes(limit - 1024)] * 2
    finally:
        hub.stop_ranks()
        for th, loop in loops:
            loop.stop.set()
            th.join(WAIT_S)
        hub.close()
