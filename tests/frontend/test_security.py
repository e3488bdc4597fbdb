"""Who can reach what (#20 item 9): every socket binds loopback by default; the KV-event
sockets, which carry token ids (prompts), need CURVE or an explicit ``insecure`` on a
network address; snapshots are built off the live send path, from a bounded queue; the
metrics endpoint binds loopback; a one-node group meets through a private file and
talks over loopback only. Real ZMQ, real HTTP, real gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import tempfile
import time
import urllib.request

import pytest
import zmq

from tpcache.cache.events import BlockStored
from tpcache.events.event_config import EventConfig, EventConfigError
from tpcache.events.metrics import CoordinatorMetrics, MetricsError
from tpcache.events.publisher import EventPublisher
from tpcache.events.subscriber import EventSubscriber, EventSubscriberError
from tpcache.transport.netsec import new_keypair, public_of

LOOPBACK = "tcp://127.0.0.1:*"


def stored(i: int) -> BlockStored:
    return BlockStored([i + 1], None, [i, i + 1], 2, None, "GPU", None)


def test_defaults_are_loopback() -> None:
    cfg = EventConfig()
    assert cfg.endpoint == "tcp://127.0.0.1:5557" and cfg.binds
    with CoordinatorMetrics() as m:
        port = m.serve(0)
        assert m.server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"python_info" in body or body == b"" or b"#" in body


@pytest.mark.parametrize(
    "kw",
    [
        {"endpoint": "tcp://*:5557"},
        {"endpoint": "tcp://0.0.0.0:5557"},
        {"endpoint": "tcp://[::]:5557"},
        {"endpoint": "tcp://10.1.2.3:5557"},
        {"endpoint": LOOPBACK, "replay_endpoint": "tcp://*:5558"},
    ],
)
def test_a_network_address_needs_curve_or_insecure(kw) -> None:
    with pytest.raises(EventConfigError, match="token ids"):
        EventConfig(**kw)
    EventConfig(**kw, insecure=True)  # said on purpose
    EventConfig(**kw, curve_secret_key=new_keypair()[1])


def test_bad_keys_are_refused() -> None:
    for bad in ("short", "x" * 39 + '"', 5):  # length, alphabet, type
        with pytest.raises(EventConfigError, match="curve"):
            EventConfig(curve_secret_key=bad)  # type: ignore[arg-type]
    with pytest.raises(EventConfigError, match="curve_client_keys"):
        EventConfig(curve_client_keys=(new_keypair()[0],))  # without a secret key
    with pytest.raises(EventConfigError):
        EventConfig(curve_secret_key=new_keypair()[1], curve_client_keys=("nope",))
    with pytest.raises(EventSubscriberError, match="curve_server_key"):
        EventSubscriber(LOOPBACK.replace("*", "1"), curve_server_key="nope")


def _receives(sub: EventSubscriber, pub: EventPublisher, seconds: float = 1.5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pub.publish([stored(1)])
        if sub.recv_live(0.05) is not None:
            return True
    return False


def test_curve_lets_in_only_who_knows_the_key() -> None:
    public, secret = new_keypair()
    assert public_of(secret) == public
    cfg = EventConfig(endpoint="tcp://*:*", replay_endpoint="tcp://*:*", curve_secret_key=secret)
    with EventPublisher(cfg) as pub:
        ep = pub.endpoint.replace("0.0.0.0", "127.0.0.1")
        rep = pub.replay_endpoint.replace("0.0.0.0", "127.0.0.1")
        with EventSubscriber(ep, rep, curve_server_key=public) as good:
            assert _receives(good, pub)
            assert good.request_snapshot(5.0)[1].events  # the blocks, over CURVE
        with EventSubscriber(ep, rep, replay_timeout=1.0) as plain:
            assert not _receives(plain, pub)  # no handshake, nothing delivered
            with pytest.raises(EventSubscriberError, match="no end marker"):
                plain.request_snapshot(1.0)  # the prompt-leaking request gets nothing
        with EventSubscriber(ep, rep, curve_server_key=new_keypair()[0]) as wrong:
            assert not _receives(wrong, pub)


def test_a_replay_request_that_cannot_be_sent_fails_in_time() -> None:
    """A subscriber without keys asking a CURVE publisher for a replay: its DEALER's
    handshake is refused, so it has no peer and a send used to block for good (the CURVE
    test above hung so, now and then). Each request ends in a typed error within its
    timeout, whenever the refusal falls."""
    import threading

    _, secret = new_keypair()
    cfg = EventConfig(endpoint="tcp://*:*", replay_endpoint="tcp://*:*", curve_secret_key=secret)
    with EventPublisher(cfg) as pub:
        ep = pub.endpoint.replace("0.0.0.0", "127.0.0.1")
        rep = pub.replay_endpoint.replace("0.0.0.0", "127.0.0.1")
        with EventSubscriber(ep, rep) as plain:
            outcomes: list[str] = []

            def ask() -> None:
                try:
                    plain.request_replay(0, 0.3)
                    outcomes.append("answered")
                except EventSubscriberError:
                    outcomes.append("refused")

            for attempt in range(20):
                t = threading.Thread(target=ask, daemon=True)
                t.start()
                t.join(10.0)
                assert not t.is_alive(), f"attempt {attempt} still blocked after 10 s"
                time.sleep(0.01 * (attempt % 5))  # land at different points of the handshake
            assert outcomes == ["refused"] * 20


def test_curve_client_keys_limit_who_may_subscribe() -> None:
    public, secret = new_keypair()
    allowed = new_keypair()
    cfg = EventConfig(endpoint=LOOPBACK, curve_secret_key=secret, curve_client_keys=(allowed[0],))
    with EventPublisher(cfg) as pub:
        with EventSubscriber(pub.endpoint, curve_server_key=public, curve_keypair=allowed) as ok:
            assert _receives(ok, pub)
        with EventSubscriber(pub.endpoint, curve_server_key=public) as other:
            assert not _receives(other, pub)  # knows the server key, not on the list


def test_unread_snapshot_requests_do_not_hold_up_the_live_stream() -> None:
    """The issue: 32 unread SNAPSHOT requests delayed the live stream by 22 s. Now the
    snapshots are built on their own thread from a queue of 4; the rest get BUSY at
    once, and a live batch still arrives promptly."""
    cfg = EventConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, snapshot_queue=4)
    # Leaving the context destroys it: the dealers are closed even if an assert fails.
    with EventPublisher(cfg) as pub, zmq.Context() as ctx:
        for base in range(0, 60_000, 3_000):
            pub.publish([stored(i) for i in range(base, base + 3_000)])
        with EventSubscriber(pub.endpoint) as sub:
            assert _receives(sub, pub, 5.0)
            dealers = []
            for _ in range(32):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect(pub.replay_endpoint)
                d.send(b"SNAPSHOT")
                dealers.append(d)
            time.sleep(0.05)
            t0 = time.monotonic()
            seq = pub.publish([stored(7)])
            while True:
                got = sub.recv_live(5.0)
                assert got is not None, "the live stream stalled"
                if got[0] == seq:
                    break
            took = time.monotonic() - t0
            print(f"live batch behind 32 snapshot requests arrived in {took * 1e3:.1f} ms")
            # Before the fix the live batch waited behind every one of the 32 snapshots
            # (22.6 s for 200k blocks in the issue). The bound leaves room for a loaded
            # 2-core machine, where 1.7 s has been seen; 270 ms is usual here.
            assert took < 4.0
            deadline = time.monotonic() + 30
            while pub.stats().snapshot_requests < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            replies = {"busy": 0, "built": 0}
            for d in dealers:
                assert d.poll(30_000)
                frames = d.recv_multipart()
                seq_frame = int.from_bytes(frames[1], "big", signed=True)
                replies["busy" if seq_frame == -2 else "built"] += 1
            print(replies)
            assert replies["built"] >= 4 and replies["busy"] >= 1
            assert replies["built"] + replies["busy"] == 32
            for d in dealers:
                d.close(0)


def test_a_taken_metrics_port_is_a_clear_error() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(MetricsError, match=f"127.0.0.1:{port}"):
            CoordinatorMetrics().serve(port)
    finally:
        s.close()


def _rank(rank: int, store: str, out) -> None:
    import torch

    from tpcache.group.tp_group import GroupSpec, TPGroup

    spec = GroupSpec(rank, 2, "127.0.0.1", 1, "gloo", 10.0, 30.0, store_path=store)
    group = TPGroup.init(spec, torch.device("cpu"))
    assert group.agree_min([rank + 1]) == [1]
    out.put((rank, os.getpid()))
    group.barrier()  # both listed before either leaves
    time.sleep(1.0)
    group.destroy()


def _listening(pid: int) -> list[str]:
    text = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in text.splitlines() if f"pid={pid}," in line]


def test_a_one_node_group_listens_on_loopback_only() -> None:
    """The TCP store of a multi-node rendezvous listens on every interface whatever host
    it is given; a one-node group meets through a file in a private directory instead,
    and gloo's sockets bind loopback."""
    d = tempfile.mkdtemp(prefix="tpcache-rdv-")
    assert os.stat(d).st_mode & 0o077 == 0  # only this user
    q: mp.Queue = mp.get_context("spawn").Queue()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, os.path.join(d, "store"), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        pids = dict(q.get(timeout=60) for _ in procs)
        addrs = [a for pid in pids.values() for a in _listening(pid)]
        print(f"listening: {addrs}")
        assert addrs, "no gloo socket seen"
        assert all(a.startswith(("127.", "[::1]")) for a in addrs), addrs
    finally:
        for p in procs:
            p.join(30)
    assert all(p.exitcode == 0 for p in procs)
