"""A rank that cannot reach its hub: its loop ends with ``ChannelConnectError`` naming the
endpoint and why (it used to return 0 as if the hub had gone, and under Ray the
coordinator then said the rank's process died); a rank whose hub goes after a good
connect still leaves quietly."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import sys
import tempfile
import threading
import time

import pytest
from channel_helpers import EchoWorker

from tpcache.transport.channel import (
    STEPS,
    Attach,
    ChannelConnectError,
    ChannelError,
    RankLoop,
    StepHub,
    serve,
)
from tpcache.transport.netsec import new_keypair


def never_dead() -> None:
    return None


def serving(rank: int, attach: Attach, connect_s: float = 10.0) -> tuple[threading.Thread, dict]:
    """A rank's loop on a thread; ``out`` gets what ``serve`` returned or raised."""
    out: dict = {}

    def body() -> None:
        try:
            out["handled"] = serve(EchoWorker(rank), rank, attach, RankLoop(), 0.02, connect_s)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_a_rank_whose_hub_is_gone_fails_naming_the_endpoint_and_the_os_error() -> None:
    """The hub closed (its directory removed) before the rank connects: ``serve`` raises
    ``ChannelConnectError`` at once, naming the rank, the endpoint and the OS error, and
    the loop is done. The error pickles whole (it crosses Ray as the loop's result)."""
    hub = StepHub(1, set(), "")
    attach = hub.attach[0]
    hub.close()
    loop = RankLoop()
    t0 = time.monotonic()
    with pytest.raises(ChannelConnectError) as caught:
        serve(EchoWorker(0), 0, attach, loop, 0.02)
    assert time.monotonic() - t0 < 2.0
    err = caught.value
    assert str(err) == (
        f"rank 0: could not connect to the step channel at {attach.endpoint}: "
        "FileNotFoundError: [Errno 2] No such file or directory"
    )
    assert (err.rank, err.endpoint, err.dead) == (0, attach.endpoint, False)
    assert isinstance(err, ChannelError) and loop.done.is_set()
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.rank, back.endpoint) == (
        ChannelConnectError,
        str(err),
        0,
        attach.endpoint,
    )


def test_a_socket_nobody_listens_on_is_refused_by_name() -> None:
    short = tempfile.mkdtemp(prefix="tpc", dir="/tmp")
    path = os.path.join(short, "s")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # the file exists; nothing listens
    try:
        attach = Attach("unix://" + path, b"r0")
        with pytest.raises(ChannelConnectError) as caught:
            serve(EchoWorker(0), 0, attach, RankLoop(), 0.02)
        assert caught.value.reason == "ConnectionRefusedError: [Errno 111] Connection refused"
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(short)


def test_a_rank_waits_for_a_place_in_a_full_queue_but_not_for_ever() -> None:
    """The hub's queue of connections not yet accepted is full (the hub is not polling):
    a rank waits for a place, and connects once the hub takes the queue; a queue that
    stays full fails at ``connect_s``."""
    hub = StepHub(1, set(), "")  # a queue of 1 (2 wait, in Linux)
    path = hub.attach[0].endpoint.removeprefix("unix://")
    stuck = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            stuck.append(s)
        t0 = time.monotonic()
        with pytest.raises(ChannelConnectError) as caught:
            serve(EchoWorker(0), 0, hub.attach[0], RankLoop(), 0.02, 0.5)
        assert 0.5 <= time.monotonic() - t0 < 5.0
        assert caught.value.reason == "not accepted within 0.5s (the hub's queue stayed full)"
        th, out = serving(0, hub.attach[0])
        time.sleep(0.3)
        assert th.is_alive() and out == {}  # waiting for a place
        hub.wait_connected(10.0, never_dead)
        t = hub.send(STEPS, [b"in"], 5.0)
        assert len(hub.collect(t, 5.0, never_dead)) == 1
    finally:
        hub.close()
        for s in stuck:
            s.close()
    th.join(10.0)
    assert out == {"handled": 1}


def test_a_tcp_rank_that_never_connects_fails_at_its_limit() -> None:
    """Nothing listens at the TCP endpoint: ZMQ retries on its own and the loop used to
    wait for ever; it now fails at ``connect_s`` saying how many attempts failed."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    loop = RankLoop()
    t0 = time.monotonic()
    with pytest.raises(ChannelConnectError) as caught:
        serve(EchoWorker(1), 1, Attach(endpoint, b"r1"), loop, 0.02, connect_s=0.5)
    took = time.monotonic() - t0
    assert 0.5 <= took < 5.0
    err = caught.value
    assert err.rank == 1 and err.endpoint == endpoint and loop.done.is_set()
    assert err.reason.startswith("not connected within 0.5s: ")
    assert "connect attempt(s) failed (refused or unreachable)" in err.reason


def test_a_tcp_rank_the_hub_does_not_let_in_is_told_why() -> None:
    hub = StepHub(1, {0}, "127.0.0.1")
    stranger = dataclasses.replace(hub.attach[0], keypair=new_keypair())
    try:
        t, out = serving(0, stranger, connect_s=1.0)
        t.join(10.0)
        assert not t.is_alive()
        err = out["error"]
        assert isinstance(err, ChannelConnectError) and err.endpoint == stranger.endpoint
        refused = "the hub refused this rank's key (CURVE handshake, status 400)"
        assert err.reason == f"not connected within 1s: {refused}"
    finally:
        hub.close()


def test_ranks_whose_hub_goes_after_a_good_connect_leave_quietly() -> None:
    """A Unix and a TCP rank connect, answer a step, and the hub closes without a STOP:
    both loops return what they handled, raising nothing."""
    hub = StepHub(2, {1}, "127.0.0.1")
    ranks = [serving(r, hub.attach[r], connect_s=0.5) for r in range(2)]
    try:
        hub.wait_connected(10.0, never_dead)
        t = hub.send(STEPS, [b"x"], 5.0)
        hub.collect(t, 5.0, never_dead)
        time.sleep(1.0)  # past connect_s: a connected rank is not held to it
        t = hub.send(STEPS, [b"y"], 5.0)
        assert len(hub.collect(t, 5.0, never_dead)) == 2
    finally:
        hub.close()
    for th, _ in ranks:
        th.join(10.0)
    assert [out for _, out in ranks] == [{"handled": 2}, {"handled": 2}]


@pytest.mark.parametrize("connect_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_connect_limit_that_is_not_seconds_is_refused(connect_s: float) -> None:
    with pytest.raises(ValueError, match="connect_s must be seconds > 0"):
        serve(EchoWorker(0), 0, Attach("unix:///nonexistent", b"r0"), RankLoop(), 0.02, connect_s)


class StrayRank:
    """A Ray rank that runs the real channel loop, at ``endpoint`` instead of the hub's
    when given (the hub's socket it was told of is gone, say)."""

    def __init__(self, rank: int, endpoint: str | None = None) -> None:
        self.rank = rank
        self.endpoint = endpoint

    def apply_steps(self, steps: list[bytes]) -> list[bytes]:
        return steps

    def serve_steps(self, attach: Attach) -> int:
        if self.endpoint is not None:
            attach = dataclasses.replace(attach, endpoint=self.endpoint)
        return serve(self, self.rank, attach, RankLoop(), 0.02)


def test_the_coordinator_reports_a_failed_connect_not_a_death(ray_cluster) -> None:
    """Under Ray, rank 1's connect fails: opening the channel raises ``RankCallError``
    for rank 1 whose cause is its ``ChannelConnectError`` (not dead, no "died"), at once
    rather than at the start timeout."""
    from ray import cloudpickle

    from tpcache.coordinator.step_path import ChannelPath
    from tpcache.coordinator.step_types import RankCallError

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray_cluster.remote(StrayRank)
    missing = "unix:///nonexistent-tpcache-test/hub.sock"
    actors = [actor.remote(0), actor.remote(1, missing)]
    try:
        ray_cluster.get([a.apply_steps.remote([]) for a in actors], timeout=60)
        t0 = time.monotonic()
        with pytest.raises(RankCallError) as caught:
            ChannelPath(actors, set(), "", 60.0, 5.0)
        assert time.monotonic() - t0 < 20.0
        err = caught.value
        assert err.rank == 1 and not err.dead
        assert isinstance(err.cause, ChannelConnectError)
        assert err.cause.endpoint == missing
        assert str(err) == (
            "rank 1: ChannelConnectError: rank 1: could not connect to the step channel at "
            f"{missing}: FileNotFoundError: [Errno 2] No such file or directory"
        )
    finally:
        for a in actors:
            ray_cluster.kill(a)
