"""The step channel's faults that a red team found: which rank a failure names when
several go, a send that must reach every rank or none (remote ranks too), a TCP rank's
loop when its hub goes without a STOP, and the hub's directory (dead hubs' ones swept,
a socket path that fits)."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time

import pytest
from channel_helpers import EchoWorker, run_rank

from tpcache.transport import private_dir as pd
from tpcache.transport.channel import STEPS, ChannelError, StepHub
from tpcache.transport.channel_msgs import ERROR, HELLO, RESULTS, pack
from tpcache.transport.frames import FrameReader, send_frame
from tpcache.transport.private_dir import PrivateDir, socket_base, sweep


def never_dead() -> None:
    return None


def fake_ranks(hub: StepHub) -> list[socket.socket]:
    """Raw sockets that say hello as the hub's local ranks (a test drives them by hand)."""
    path = hub.attach[0].endpoint.removeprefix("unix://")
    socks = []
    for r in range(hub.world_size):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        send_frame(s, HELLO + hub.attach[r].identity)
        socks.append(s)
    hub.wait_connected(5.0, never_dead)
    return socks


def close_all(hub: StepHub, loops) -> None:
    """Stop the rank loops, close the hub, and wait for the loops to leave."""
    for _th, lp in loops:
        lp.stop.set()
    hub.close()
    for th, _ in loops:
        th.join(10)


def read_one(sock: socket.socket) -> bytes:
    reader = FrameReader(sock)
    while (body := reader.next()) is None:
        reader.fill()
    return body


def test_a_rank_gone_without_answering_is_named_when_another_closed_first() -> None:
    """Rank 0 answers and then its socket closes; rank 1's closes without an answer. The
    wait fails at once naming rank 1 as gone (it used to look at the first closed link
    only, and waited the whole timeout to call rank 1 late)."""
    hub = StepHub(2, set(), "")
    try:
        socks = fake_ranks(hub)
        t = hub.send(STEPS, [b"x"], 5.0)
        body = read_one(socks[0])
        send_frame(socks[0], pack(RESULTS, body[1:9], [b"ok"]))
        time.sleep(0.1)
        hub.ready(t)
        socks[0].close()
        time.sleep(0.1)
        hub.ready(t)
        socks[1].close()
        time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(ChannelError) as err:
            hub.collect(t, 8.0, never_dead)
        assert time.monotonic() - t0 < 2.0
        assert err.value.rank == 1 and err.value.dead
    finally:
        hub.close()


def test_a_peer_error_does_not_hide_the_rank_whose_socket_closed() -> None:
    """Rank 1 goes mid-step and rank 0's collective fails because of it (it answers an
    error): the wait names rank 1 as gone, not rank 0's error."""
    hub = StepHub(2, set(), "")
    try:
        socks = fake_ranks(hub)
        t = hub.send(STEPS, [b"x"], 5.0)
        body = read_one(socks[0])
        socks[1].close()
        exc = RuntimeError("connection closed by peer")
        send_frame(socks[0], pack(ERROR, body[1:9], [pickle.dumps(exc)]))
        time.sleep(0.1)
        with pytest.raises(ChannelError) as err:
            hub.collect(t, 10.0, never_dead)
        assert err.value.rank == 1 and err.value.dead
    finally:
        hub.close()


def test_a_full_rank_waiting_for_a_gone_peer_is_not_the_one_named() -> None:
    """Rank 0 has all its messages unanswered (it waits in a collective for rank 1) and
    rank 1's socket closes: the next send names rank 1 as gone at once, not rank 0 as
    having stopped reading at the timeout."""
    hub = StepHub(2, set(), "", hwm=2)
    try:
        socks = fake_ranks(hub)
        hub.send(STEPS, [b"a"], 5.0)
        hub.send(STEPS, [b"b"], 5.0)
        socks[1].close()
        t0 = time.monotonic()
        with pytest.raises(ChannelError) as err:
            hub.send(STEPS, [b"c"], 8.0)
        assert time.monotonic() - t0 < 2.0
        assert err.value.rank == 1 and err.value.dead
    finally:
        hub.close()


def test_a_send_refused_for_a_slow_remote_rank_reaches_no_local_rank() -> None:
    """A remote (TCP) rank that stopped reading fails the send before the message goes to
    any rank, as a local one does: the local rank never gets a message without a
    ticket, and no ticket is taken for it."""
    hub = StepHub(2, {1}, "127.0.0.1", hwm=2)
    w0 = EchoWorker(0)
    loops = [run_rank(0, hub.attach[0], worker=w0), run_rank(1, hub.attach[1], slow_s=2.0)]
    try:
        hub.wait_connected(10.0, never_dead)
        tickets = []
        with pytest.raises(ChannelError) as err:
            for _ in range(50):
                tickets.append(hub.send(STEPS, [os.urandom(1 << 16)], 0.3))
                hub.ready(tickets[-1])
        assert err.value.rank == 1 and not err.value.dead
        time.sleep(0.5)
        hub.ready(tickets[-1])
        assert len(w0.seen) == len(tickets)  # not one more
        assert hub.send(STEPS, [b"next"], 10.0) == len(tickets)  # the next ticket, in order
    finally:
        close_all(hub, loops)


def test_a_tcp_rank_leaves_its_loop_when_the_hub_goes_without_a_stop() -> None:
    """The hub closes without a STOP reaching its ranks (it crashed, or the STOP was
    dropped): the TCP rank's loop leaves as the Unix rank's does (it used to poll its
    reconnecting DEALER forever)."""
    hub = StepHub(2, {1}, "127.0.0.1")
    loops = [run_rank(r, hub.attach[r]) for r in range(2)]
    try:
        hub.wait_connected(10.0, never_dead)
        t = hub.send(STEPS, [b"x"], 5.0)
        hub.collect(t, 5.0, never_dead)
    finally:
        hub.close()
    for th, _ in loops:
        th.join(5.0)
    assert [th.is_alive() for th, _ in loops] == [False, False]
    assert all(lp.done.is_set() for _, lp in loops)


def _aged(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.mark.parametrize("prefix", [pd.HUB_PREFIX, pd.RDV_PREFIX])
def test_a_dead_owners_directory_is_swept_and_a_live_ones_is_not(tmp_path, prefix) -> None:
    """A hub's (or a rendezvous file's) directory holds a lock while its owner lives; a
    later one of the same kind removes the directories whose lock is free (their owner
    was killed: nothing else removes them), and those without a lock once they are old.
    A live owner's, a young one's and another kind's stay."""
    base = str(tmp_path)
    live = PrivateDir(prefix, base)
    dead = tempfile.mkdtemp(prefix=prefix, dir=base)
    open(os.path.join(dead, pd.LOCK), "w").close()  # a lock nobody holds
    old = tempfile.mkdtemp(prefix=prefix, dir=base)  # no lock (before locks)
    young = tempfile.mkdtemp(prefix=prefix, dir=base)
    open(os.path.join(young, pd.LOCK), "w").close()
    other = tempfile.mkdtemp(prefix="someone-else-", dir=base)
    for p in (live.path, dead, other):
        _aged(p, 30)
    _aged(old, 2 * pd.STALE_S)
    try:
        assert sorted(sweep(base, prefix)) == sorted([dead, old])
        assert sorted(os.listdir(base)) == sorted(
            os.path.basename(p) for p in (live.path, young, other)
        )
    finally:
        live.remove()
    _aged(young, 30)
    assert sweep(base, prefix) == [young]


def test_a_killed_ranks_rendezvous_directory_goes_with_the_next_group(tmp_path) -> None:
    """A rendezvous store's directory whose owner died (its lock free) is removed when
    the next store on the machine is made; its own is left until it is dropped."""
    from tpcache.group.spec import StoreDir

    orphan = tempfile.mkdtemp(prefix=pd.RDV_PREFIX)
    open(os.path.join(orphan, pd.LOCK), "w").close()
    _aged(orphan, 30)
    store = StoreDir()
    path = os.path.dirname(store.new_store())
    try:
        assert not os.path.exists(orphan) and os.path.isdir(path)
    finally:
        store.drop()
    assert not os.path.exists(path)


def test_a_hub_closes_its_directory_and_the_lock_goes_with_it(monkeypatch) -> None:
    base = tempfile.mkdtemp(prefix="tpcache-base-", dir="/tmp")  # this test's temp dir alone
    monkeypatch.setattr(tempfile, "tempdir", base)
    try:
        hub = StepHub(1, set(), "")
        path = os.path.dirname(hub.attach[0].endpoint.removeprefix("unix://"))
        assert os.listdir(base) == [os.path.basename(path)]
        assert sorted(os.listdir(path)) == sorted([pd.LOCK, pd.SOCKET])
        hub.close()
        assert not os.path.exists(path)
        remote_only = StepHub(1, {0}, "127.0.0.1")  # no local rank: no directory at all
        assert os.listdir(base) == []
        remote_only.close()
    finally:
        os.rmdir(base)


def test_a_temp_dir_too_long_for_a_socket_path_falls_back_to_tmp(monkeypatch) -> None:
    """A Unix socket path has at most 107 bytes: under a long TMPDIR the hub's socket goes
    in /tmp instead (it used to fail with a bare OSError), and the ranks still connect."""
    long_dir = tempfile.mkdtemp(prefix="x" * 90, dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", long_dir)
    try:
        assert socket_base() == "/tmp"
        hub = StepHub(1, set(), "")
        loops = [run_rank(0, hub.attach[0])]
        try:
            hub.wait_connected(10.0, never_dead)
            assert hub.attach[0].endpoint.startswith("unix:///tmp/" + pd.HUB_PREFIX)
            t = hub.send(STEPS, [b"x"], 5.0)
            assert len(hub.collect(t, 5.0, never_dead)) == 1
        finally:
            close_all(hub, loops)
        assert os.listdir(long_dir) == []
    finally:
        os.rmdir(long_dir)
