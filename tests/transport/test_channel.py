"""The step channel alone (``tpcache.transport.channel``): the coordinator's hub and the
ranks' loops over real sockets (Unix sockets, and ZMQ CURVE TCP on loopback), with stand-in
workers that answer with the length and hash of each step (``channel_helpers``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import msgspec
import pytest
from channel_helpers import EchoWorker, expected, rank_process, run_rank

from tpcache.transport.channel import CALL, STEPS, ChannelError, RankErrors, StepHub
from tpcache.transport.channel_msgs import pack, unpack
from tpcache.transport.netsec import new_keypair

WRITER = "tpcache-hub-writer"  # the name of a hub's writer thread (transport/unix_writer.py)


def never_dead() -> None:
    return None


def start(hub: StepHub, slow: dict[int, float] | None = None):
    loops = [run_rank(r, hub.attach[r], (slow or {}).get(r, 0.0)) for r in range(hub.world_size)]
    hub.wait_connected(10.0, never_dead)
    return loops


def stop(hub: StepHub, loops) -> None:
    hub.stop_ranks()
    for t, loop in loops:
        loop.stop.set()
        t.join(5)
        assert not t.is_alive(), "a rank loop did not leave"
    hub.close()


def test_messages_arrive_whole_and_in_order() -> None:
    """Many messages of all sizes, several steps a message, one of 64 MB (far larger than
    any buffer on the way): every rank applies each whole, in order, and its results
    come back under the right ticket."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    hub = StepHub(2, set(), "")
    loops = start(hub)
    try:
        sent: list[tuple[int, list[bytes]]] = []
        for i in range(1500):
            n = rng.randrange(1, 4)
            steps = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(n)]
            if i in (100, 900):
                steps.append(rng.randbytes(8 << 20))
            if i == 500:
                steps = [os.urandom(64 << 20)]
            sent.append((hub.send(STEPS, steps, 30.0), steps))
            if len(sent) > 20:  # keep a few in flight, collect the oldest
                ticket, steps = sent.pop(0)
                for frames in hub.collect(ticket, 30.0, never_dead):
                    assert frames == [expected(s) for s in steps]
        for ticket, steps in sent:
            for frames in hub.collect(ticket, 30.0, never_dead):
                assert frames == [expected(s) for s in steps]
    finally:
        stop(hub, loops)


def test_a_body_keeps_its_kind_number_and_parts_and_a_foreign_one_is_refused() -> None:
    """One frame per message: the kind byte, the 8-byte number and every part (empty,
    binary, large) come back as sent; a body the channel did not make raises."""
    parts = [b"", bytes(range(256)), os.urandom(1 << 20), b"\x00"]
    body = pack(STEPS, (2**64 - 1).to_bytes(8, "big"), parts)
    assert body[:1] == STEPS and int.from_bytes(body[1:9], "big") == 2**64 - 1
    assert unpack(body) == parts
    assert unpack(pack(CALL, bytes(8), [])) == []
    with pytest.raises(msgspec.DecodeError):
        unpack(STEPS + bytes(8) + b"\xc1")  # 0xc1: never used by msgpack


def test_calls_and_steps_share_one_order_and_tickets_may_be_taken_out_of_order() -> None:
    import pickle

    hub = StepHub(2, set(), "")
    loops = start(hub)
    try:
        t0 = hub.send(STEPS, [b"a"], 5.0)
        t1 = hub.send(CALL, [pickle.dumps(("echo", ("x",), None))], 5.0)
        t2 = hub.send(CALL, [pickle.dumps(("echo", (5,), 1))], 5.0)  # rank 1 alone
        t3 = hub.send(STEPS, [b"bb", b"ccc"], 5.0)
        assert [pickle.loads(f[0]) for f in hub.collect(t1, 5.0, never_dead)] == [
            (0, "x"),
            (1, "x"),
        ]
        assert [pickle.loads(f[0]) for f in hub.collect(t2, 5.0, never_dead)] == [None, (1, 5)]
        assert hub.collect(t3, 5.0, never_dead)[1] == [expected(b"bb"), expected(b"ccc")]
        assert hub.collect(t0, 5.0, never_dead)[0] == [expected(b"a")]
        assert [w for w in (loops[0], loops[1])]  # both still running
    finally:
        stop(hub, loops)


def test_a_rank_error_comes_back_as_itself() -> None:
    hub = StepHub(2, set(), "")
    loops = start(hub)
    try:
        t = hub.send(STEPS, [b"fail"], 5.0)
        with pytest.raises(RankErrors) as caught:
            hub.collect(t, 5.0, never_dead)
        assert [(r, type(e).__name__) for r, e in caught.value.errors] == [
            (0, "ValueError"),
            (1, "ValueError"),
        ]
        assert "rank 1 refused" in str(caught.value.errors[1][1])
        t = hub.send(STEPS, [b"ok"], 5.0)  # the channel goes on
        assert hub.collect(t, 5.0, never_dead)[0] == [expected(b"ok")]
    finally:
        stop(hub, loops)


def test_a_slow_reader_holds_the_writer_back_and_nothing_is_lost() -> None:
    """Rank 1 takes 0.5 s a step. With 2 messages unanswered allowed per rank, the hub's
    send waits for it and, past its timeout, fails naming rank 1 without having sent the
    message to any rank; everything sent before arrives whole and in order. (The
    messages are small enough for the socket buffers: a message that is not is written
    whole before a send returns, the next test.)"""
    hub = StepHub(2, set(), "", hwm=2)
    first = EchoWorker(0)
    loops = [run_rank(0, hub.attach[0], worker=first), run_rank(1, hub.attach[1], 0.5)]
    hub.wait_connected(10.0, never_dead)
    try:
        payload = [os.urandom(16 << 10)]
        sent = []
        with pytest.raises(ChannelError) as caught:
            for _ in range(200):
                sent.append(hub.send(STEPS, payload, 0.2))
        assert caught.value.rank == 1 and "stopped reading" in str(caught.value)
        assert 2 <= len(sent) < 200
        print(f"{len(sent)} messages went before the writer was held back")
        for ticket in sent:  # the reader catches up: every one arrives, in order
            assert hub.collect(ticket, 30.0, never_dead)[1] == [expected(payload[0])]
        # The message that timed out reached no rank (every rank gets a message or none
        # does); replies carry their ticket, so the next message is answered as itself.
        assert len(first.seen) == len(sent)
        t = hub.send(STEPS, [b"after"], 10.0)
        assert hub.collect(t, 30.0, never_dead)[1] == [expected(b"after")]
    finally:
        stop(hub, loops)


def test_a_rank_that_dies_fails_the_wait_and_the_next_send_at_once() -> None:
    hub = StepHub(2, set(), "")
    loop0 = run_rank(0, hub.attach[0])
    proc = mp.get_context("spawn").Process(target=rank_process, args=(1, hub.attach[1]))
    proc.start()
    try:
        hub.wait_connected(60.0, never_dead)
        t = hub.send(STEPS, [b"x"], 5.0)
        hub.collect(t, 10.0, never_dead)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)

        def dead() -> int | None:
            return None if proc.is_alive() else 1

        t0 = time.monotonic()
        with pytest.raises(ChannelError) as caught:
            t = hub.send(STEPS, [b"y"], 5.0)
            hub.collect(t, 30.0, dead)
        assert caught.value.rank == 1 and caught.value.dead
        assert time.monotonic() - t0 < 2.0
        deadline = time.monotonic() + 5  # the hub sees the disconnect and fails sends
        while True:
            try:
                hub.send(STEPS, [b"z"], 1.0)
            except ChannelError as exc:
                assert exc.rank == 1 and exc.dead
                break
            assert time.monotonic() < deadline, "a send to a dead rank kept succeeding"
            time.sleep(0.05)
    finally:
        stop(hub, [loop0])
        if proc.is_alive():
            proc.kill()


def test_shutdown_with_steps_in_flight_returns_and_the_loops_leave() -> None:
    hub = StepHub(2, set(), "")
    loops = start(hub, slow={0: 0.2, 1: 0.2})
    for _ in range(10):
        hub.send(STEPS, [b"s"], 5.0)
    t0 = time.monotonic()
    stop(hub, loops)  # asserts every loop left
    assert time.monotonic() - t0 < 5.0


def test_curve_tcp_for_remote_ranks_lets_in_only_their_keys() -> None:
    hub = StepHub(2, {1}, "127.0.0.1")
    a0, a1 = hub.attach
    assert a0.endpoint.startswith("unix://") and a0.server_key is None
    assert a1.endpoint.startswith("tcp://127.0.0.1:") and a1.server_key and a1.keypair
    # A client with another key pair is not let in: no hello ever arrives.
    import dataclasses

    stranger = dataclasses.replace(a1, keypair=new_keypair())
    t_bad, loop_bad = run_rank(1, stranger)
    try:
        with pytest.raises(ChannelError, match="did not connect"):
            StepHub.wait_connected(hub, 1.5, never_dead)
    finally:
        loop_bad.stop.set()
        t_bad.join(5)
    loops = [run_rank(0, a0), run_rank(1, a1)]
    try:
        hub.wait_connected(10.0, never_dead)
        t = hub.send(STEPS, [b"over curve"], 5.0)
        assert hub.collect(t, 5.0, never_dead) == [[expected(b"over curve")]] * 2
    finally:
        stop(hub, loops)


def test_the_socket_is_private_and_a_stranger_is_not_a_rank() -> None:
    """The local ranks' socket sits in a directory only this user can enter; a process
    that connects to it without one of the hub's identities is dropped, never counted as
    a rank, and the real ranks connect and are answered as before."""
    import socket
    import stat

    from tpcache.transport.frames import send_frame

    hub = StepHub(2, set(), "")
    path = hub.attach[0].endpoint.removeprefix("unix://")
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o077 == 0
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(path)
    send_frame(stranger, b"H" + b"r0-forged")
    with pytest.raises(ChannelError, match="did not connect"):
        hub.wait_connected(0.5, never_dead)
    stranger.settimeout(5.0)
    assert stranger.recv(1) == b""  # the hub closed it
    stranger.close()
    loops = start(hub)
    try:
        t = hub.send(STEPS, [b"mine"], 5.0)
        assert hub.collect(t, 5.0, never_dead) == [[expected(b"mine")]] * 2
    finally:
        stop(hub, loops)


def test_a_rank_that_stops_reading_mid_message_never_blocks_the_writer() -> None:
    """Rank 1 is stopped (SIGSTOP) and sent 16 MB, far more than a socket buffer holds:
    the send returns at once (the hub's writer takes the rest), rank 0 gets the message
    whole, and at the send's timeout rank 1 is cut off: the wait for the answers fails
    naming it, its stream is cut (it may end inside the message), the next send fails at
    once, and once it runs again its loop leaves instead of reading half a message."""
    hub = StepHub(2, set(), "")
    first = EchoWorker(0)
    loop0 = run_rank(0, hub.attach[0], worker=first)
    proc = mp.get_context("spawn").Process(target=rank_process, args=(1, hub.attach[1]))
    proc.start()
    try:
        hub.wait_connected(60.0, never_dead)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        ticket = hub.send(STEPS, [bytes(16 << 20)], 3.0)  # time enough for rank 0, even loaded
        assert time.monotonic() - t0 < 1.5, "the send waited for a rank that is not reading"
        with pytest.raises(ChannelError) as caught:
            hub.collect(ticket, 30.0, never_dead)
        assert caught.value.rank == 1 and caught.value.dead
        assert "stopped reading" in str(caught.value)
        assert 3.0 <= time.monotonic() - t0 < 10.0
        assert first.seen == [16 << 20]  # rank 0 answered before rank 1 was cut
        with pytest.raises(ChannelError) as caught:
            hub.send(STEPS, [b"z"], 1.0)
        assert caught.value.rank == 1 and caught.value.dead
        assert "stopped reading" in str(caught.value)
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(10)
        assert proc.exitcode == 0  # its loop left: the hub's end was gone
    finally:
        stop(hub, [loop0])
        if proc.is_alive():
            proc.kill()


def test_a_large_message_to_a_busy_rank_does_not_hold_the_sender() -> None:
    """Both ranks are busy 1.5 s with a step; a message of 8 MB (far more than a socket
    buffer holds) sent meanwhile returns at once instead of waiting for them to read, a
    small one after it too, and both arrive whole and in order once the ranks are free.
    The writer's thread is gone after close."""
    before = set(threading.enumerate())
    hub = StepHub(2, set(), "")
    workers = [EchoWorker(0, 1.5), EchoWorker(1, 1.5)]
    loops = [run_rank(r, hub.attach[r], worker=workers[r]) for r in range(2)]
    hub.wait_connected(10.0, never_dead)
    try:
        first = hub.send(STEPS, [b"busy"], 10.0)
        time.sleep(0.2)  # the ranks are in their step now
        big = os.urandom(8 << 20)
        t0 = time.monotonic()
        t1 = hub.send(STEPS, [big], 30.0)
        t2 = hub.send(STEPS, [b"small"], 30.0)
        sent_s = time.monotonic() - t0
        assert sent_s < 0.5, f"the sends took {sent_s:.2f}s: they waited for busy ranks"
        assert hub.collect(first, 30.0, never_dead)[0] == [expected(b"busy")]
        assert hub.collect(t1, 30.0, never_dead) == [[expected(big)], [expected(big)]]
        assert hub.collect(t2, 30.0, never_dead) == [[expected(b"small")]] * 2
        assert [w.seen for w in workers] == [[4, 8 << 20, 5]] * 2
    finally:
        writers = [t for t in set(threading.enumerate()) - before if t.name == WRITER]
        stop(hub, loops)
        assert len(writers) == 1 and not writers[0].is_alive()


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    """The local path's framing alone, over a socket pair: frames of every size (empty,
    a header's length, larger than the reader's chunk) written in pieces cut at random
    points, headers included, come out whole and in order; the reader's buffer is
    compacted as it goes (it never holds more than a chunk and a frame)."""
    import socket

    from tpcache.transport.frames import CHUNK, FrameReader, frame

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    bodies = [
        rng.randbytes(rng.choice([0, 1, 7, 8, 9, 300, 70_000, 3 * CHUNK + 5])) for _ in range(400)
    ]
    wire = b"".join(b"".join(frame(b)) for b in bodies)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def write() -> None:
        pos = 0
        while pos < len(wire):
            n = rng.randrange(1, 20_000)
            a.sendall(wire[pos : pos + n])
            pos += n
        a.close()

    writer = threading.Thread(target=write)
    writer.start()
    reader = FrameReader(b)
    got: list[bytes] = []
    biggest = 0
    while True:
        body = reader.next()
        if body is not None:
            got.append(body)
            continue
        if not reader.fill():
            break
        biggest = max(biggest, reader.held)
    writer.join()
    b.close()
    assert got == bodies
    assert reader.next() is None
    assert biggest <= 2 * CHUNK + max(map(len, bodies)) + 8


def test_a_send_before_a_local_rank_connects_fails_at_once_naming_it() -> None:
    """Nothing is queued for a rank the hub has never heard from: the send fails at
    once, naming the first such rank, and no ticket is taken."""
    hub = StepHub(2, set(), "")
    loops = [run_rank(1, hub.attach[1])]
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError) as caught:
            hub.send(STEPS, [b"early"], 5.0)
        assert caught.value.rank == 0 and caught.value.dead
        assert "has not connected" in str(caught.value)
        assert time.monotonic() - t0 < 1.0
        loops.append(run_rank(0, hub.attach[0]))
        hub.wait_connected(10.0, never_dead)
        t = hub.send(STEPS, [b"now"], 5.0)
        assert t == 0 and hub.collect(t, 5.0, never_dead) == [[expected(b"now")]] * 2
    finally:
        stop(hub, loops)
