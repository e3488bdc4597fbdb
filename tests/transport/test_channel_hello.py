"""Connections to a hub's Unix socket that do not say hello: closed after the hub's
``hello_s`` (they used to be kept for ever), at once for a first frame no hello can be,
never more than ``SPARE_HELLOS`` beyond one per rank at a time; the hub's ranks go on
unaffected, a rank whose hello is late but in time among them."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from channel_helpers import expected, run_rank

from tpcache.transport.channel import STEPS, StepHub
from tpcache.transport.channel_msgs import HELLO, RESULTS, pack
from tpcache.transport.frames import FrameReader, send_frame
from tpcache.transport.unix_accept import HELLO_S, SPARE_HELLOS


def never_dead() -> None:
    return None


def hub_path(hub: StepHub) -> str:
    return hub.attach[0].endpoint.removeprefix("unix://")


def hub_fds(path: str) -> int:
    """This process's descriptors that are the hub's sockets at ``path``: its listener and
    the connections it accepted (a client's end has no path in /proc/net/unix)."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f]
    inodes = {row[6] for row in rows if len(row) == 8 and row[7] == path}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(f"/proc/self/fd/{fd}")[8:-1] in inodes  # socket:[inode]
    return n


def client(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.setblocking(False)
    return s


def is_closed(s: socket.socket) -> bool:
    """Whether the hub closed its end (the stream ended) rather than keeping it."""
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False


def step(hub: StepHub, data: bytes) -> None:
    """One step through every rank, answered within a generous bound."""
    t = hub.send(STEPS, [data], 5.0)
    assert hub.collect(t, 10.0, never_dead) == [[expected(data)]] * hub.world_size


def test_a_silent_connection_is_closed_after_the_limit_and_the_ranks_go_on() -> None:
    """A client connects before the ranks and says nothing: the ranks connect and are
    served meanwhile, and the hub closes the client's connection once ``hello_s`` has
    passed (not before), leaving only its listener and the ranks' sockets."""
    hub = StepHub(2, set(), "", hello_s=1.0)
    path = hub_path(hub)
    t0 = time.monotonic()
    silent = client(path)
    loops = [run_rank(r, hub.attach[r]) for r in range(2)]
    try:
        hub.wait_connected(10.0, never_dead)
        closed_at = None
        while closed_at is None and time.monotonic() - t0 < 15.0:
            step(hub, b"on")
            if is_closed(silent):
                closed_at = time.monotonic() - t0
            time.sleep(0.02)
        assert closed_at is not None, "the silent connection was kept"
        assert 1.0 <= closed_at < 8.0
        assert hub_fds(path) == 3  # the listener and the two ranks'
        step(hub, b"after")
    finally:
        silent.close()
        for _th, lp in loops:
            lp.stop.set()
        hub.close()
        for th, _ in loops:
            th.join(10)


def test_a_rank_whose_hello_is_late_but_in_time_is_served_past_the_limit() -> None:
    """A rank says hello 0.5 s after its connect, within a limit of 2 s: it is a rank, and
    it is still served after the limit has passed (only connections that have not said
    hello are held to it)."""
    hub = StepHub(2, set(), "", hello_s=2.0)
    raw = client(hub_path(hub))
    loops = [run_rank(1, hub.attach[1])]
    try:
        hub.ready(-1)  # accepted now: its 2 s start
        time.sleep(0.5)
        raw.setblocking(True)
        send_frame(raw, HELLO + hub.attach[0].identity)
        hub.wait_connected(10.0, never_dead)
        reader = FrameReader(raw)
        for data in (b"before", b"past the limit"):
            t = hub.send(STEPS, [data], 5.0)
            while (body := reader.next()) is None:
                reader.fill()
            send_frame(raw, pack(RESULTS, body[1:9], [expected(data)]))
            assert hub.collect(t, 10.0, never_dead) == [[expected(data)]] * 2
            if data == b"before":
                time.sleep(2.5)
    finally:
        raw.close()
        for _th, lp in loops:
            lp.stop.set()
        hub.close()
        for th, _ in loops:
            th.join(10)


@pytest.mark.parametrize(
    "first",
    [
        (1 << 40).to_bytes(8, "little"),  # a header no hello can have, no body yet
        bytes(8),  # an empty frame
        b"\x03" + bytes(7) + b"abc",  # a whole frame that is not a hello
    ],
    ids=["long-header", "empty-frame", "not-a-hello"],
)
def test_a_first_frame_that_is_no_hello_is_closed_at_once(first: bytes) -> None:
    """Well inside a limit of 60 s: the hub closes the connection as soon as it reads the
    frame (a header longer than any hello included: it used to wait for that body)."""
    hub = StepHub(1, set(), "", hello_s=60.0)
    path = hub_path(hub)
    stranger = client(path)
    try:
        stranger.send(first)
        deadline = time.monotonic() + 10.0
        while not is_closed(stranger):
            assert time.monotonic() < deadline, "a connection that is no rank was kept"
            hub.ready(-1)
            time.sleep(0.02)
        links = hub.unix_links
        assert hub_fds(path) == 1 and links is not None and not links.waiting
    finally:
        stranger.close()
        hub.close()


def test_many_silent_clients_do_not_pile_up_the_hubs_descriptors() -> None:
    """80 clients connect and say nothing while the hub serves its rank: it never holds
    more than its listener, its rank and ``SPARE_HELLOS`` + 1 waiting connections (one
    per rank beyond the spares); the oldest go first, and all are closed by the limit."""
    hub = StepHub(1, set(), "", hello_s=1.5)
    path = hub_path(hub)
    loops = [run_rank(0, hub.attach[0])]
    clients: list[socket.socket] = []

    def flood() -> None:
        for _ in range(80):  # a blocking connect waits while the hub's queue is full
            clients.append(client(path))

    try:
        hub.wait_connected(10.0, never_dead)
        flooder = threading.Thread(target=flood)
        flooder.start()
        most = 0
        while flooder.is_alive():
            step(hub, b"busy")
            most = max(most, hub_fds(path))
        flooder.join()
        step(hub, b"busy")
        most = max(most, hub_fds(path))
        assert most <= 2 + 1 + SPARE_HELLOS
        closed = [is_closed(s) for s in clients]
        let_go = closed.count(True)
        print(f"at most {most} hub sockets; {let_go} of 80 let go before the limit")
        assert let_go >= 80 - 1 - SPARE_HELLOS  # all but the newest waiting ones
        assert closed == [True] * let_go + [False] * (80 - let_go)  # the oldest first
        deadline = time.monotonic() + 15.0
        while not all(map(is_closed, clients)):
            assert time.monotonic() < deadline, "silent connections were kept"
            step(hub, b"waiting")
            time.sleep(0.02)
        assert hub_fds(path) == 2  # the listener and the rank's
        step(hub, b"after")
    finally:
        for s in clients:
            s.close()
        for _th, lp in loops:
            lp.stop.set()
        hub.close()
        for th, _ in loops:
            th.join(10)


@pytest.mark.parametrize("hello_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_hello_limit_that_is_not_seconds_is_refused(hello_s: float) -> None:
    with pytest.raises(ValueError, match="hello_s must be seconds > 0"):
        StepHub(1, set(), "", hello_s=hello_s)
    hub = StepHub(1, set(), "")
    links = hub.unix_links
    assert links is not None and links.hello_s == HELLO_S
    hub.close()
