"""The KV-event publisher against a subscriber that knows only the wire format.

The wire structs below are written from the spec (DESIGN.md "KV events"), not imported
from tpcache, so a change to tpcache's structs that breaks the format fails here.
All sockets are real ZMQ on loopback; every wait is bounded.
"""

from __future__ import annotations

import itertools
import random
import tempfile
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from vllm_wire import VLLM_ARRAY_WIRE, OldRemoved, OldStored

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from tpcache.events.publisher import (
    EventConfig,
    EventConfigError,
    EventPublisher,
    EventPublisherError,
    InvalidEventError,
)

LOOPBACK = "tcp://127.0.0.1:*"
END = [b"", b"\xff" * 8, b""]
WAIT_S = 5.0


class WStored(msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class WRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None


class WCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class WBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[WStored | WRemoved | WCleared]
    data_parallel_rank: int | None


WIRE = msgspec.msgpack.Decoder(WBatch)
Index = dict[tuple[str | None, int], tuple[int | None, tuple[int, ...]]]


def fold(index: Index, batch: WBatch, *, parents_first: bool = False) -> None:
    """The reference fold; with ``parents_first`` a store under an unknown parent fails."""
    for ev in batch.events:
        match ev:
            case WStored():
                parent, n = ev.parent_block_hash, ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    if parents_first and parent is not None:
                        assert (ev.medium, parent) in index, f"child {h} before parent {parent}"
                    index[(ev.medium, h)] = (parent, tuple(ev.token_ids[i * n : (i + 1) * n]))
                    parent = h
            case WRemoved():
                for h in ev.block_hashes:
                    del index[(ev.medium, h)]
            case WCleared():
                index.clear()


def make_stream(seed: int, n_batches: int = 60, block_size: int = 4):
    """Random store/remove-leaf/clear batches, and the index they leave behind."""
    print(f"stream seed {seed}")
    rng = random.Random(seed)
    stored: Index = {}
    ids = itertools.count(1)
    batches = []
    for _ in range(n_batches):
        events = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            medium = rng.choice(["GPU", "GPU", "CPU"])
            on_medium = [k for k in stored if k[0] == medium]
            if r < 0.03:
                events.append(AllBlocksCleared())
                stored.clear()
            elif r < 0.35 and on_medium:
                parents = {(k[0], p) for k, (p, _) in stored.items()}
                leaves = [k for k in on_medium if k not in parents]
                gone = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
                events.append(BlockRemoved([h for _, h in gone], medium=medium))
                for k in gone:
                    del stored[k]
            else:
                parent = rng.choice([None, *(h for _, h in on_medium)])
                hashes, tokens = [], []
                for _ in range(rng.randint(1, 4)):
                    h = (next(ids) * 0x9E3779B97F4A7C15) % (1 << 64)
                    toks = [rng.randrange(50_000) for _ in range(block_size)]
                    stored[(medium, h)] = (parent if not hashes else hashes[-1], tuple(toks))
                    hashes.append(h)
                    tokens.extend(toks)
                events.append(BlockStored(hashes, parent, tokens, block_size, medium=medium))
        batches.append(events)
    return batches, stored


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def publisher() -> Iterator:
    made: list[EventPublisher] = []

    def make(**kw) -> EventPublisher:
        kw.setdefault("endpoint", LOOPBACK)
        kw.setdefault("replay_endpoint", LOOPBACK)
        made.append(EventPublisher(EventConfig(**kw)))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def sub_socket(ctx: zmq.Context, endpoint: str, topic: bytes = b"", hwm: int = 0) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    if hwm:
        sock.setsockopt(zmq.RCVHWM, hwm)
    sock.connect(endpoint)
    return sock


def recv_msg(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(int(WAIT_S * 1000)), "timed out waiting for a message"
    return sock.recv_multipart()


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8
    return int.from_bytes(frame, "big", signed=True)


def wait_subscribed(pub: EventPublisher, sub: zmq.Socket) -> list[list[bytes]]:
    """Publish empty probe batches until the SUB gets one (slow joiner); returns it."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pub.publish([])
        if sub.poll(20):
            return [sub.recv_multipart()]
    raise AssertionError("subscriber never connected")


def recv_through(sub: zmq.Socket, last_seq: int, got: list[list[bytes]]) -> list[list[bytes]]:
    while seq_of(got[-1][1]) < last_seq:
        got.append(recv_msg(sub))
    return got


def request(dealer: zmq.Socket, *frames: bytes) -> list[list[bytes]]:
    """Send a replay-socket request and collect the reply through the end marker."""
    dealer.send_multipart(list(frames))
    replies = [recv_msg(dealer)]
    while replies[-1] != END:
        replies.append(recv_msg(dealer))
    return replies


def test_live_stream_folds_to_expected_index(ctx, publisher):
    batches, expected = make_stream(seed=1234)
    pub = publisher(topic="kv", data_parallel_rank=3)
    sub = sub_socket(ctx, pub.endpoint, b"kv")
    got = wait_subscribed(pub, sub)
    seqs = [pub.publish(events) for events in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(batches)))
    recv_through(sub, seqs[-1], got)
    assert all(len(m) == 3 and m[0] == b"kv" for m in got)
    got_seqs = [seq_of(m[1]) for m in got]
    assert got_seqs == list(range(got_seqs[0], seqs[-1] + 1)), "gap or reorder"
    index: Index = {}
    for msg in got:
        batch = WIRE.decode(msg[2])
        assert batch.data_parallel_rank == 3
        fold(index, batch)
    assert index == expected
    # The probes before the subscriber joined took the first numbers: 0 and up.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    replayed = request(dealer, (0).to_bytes(8, "big"))
    assert [seq_of(m[1]) for m in replayed[:-1]] == list(range(seqs[-1] + 1))


def test_array_encoding_live_replay_and_snapshot(ctx, publisher):
    pub = publisher(topic="kv", encoding="array", data_parallel_rank=1)
    sub = sub_socket(ctx, pub.endpoint, b"kv")
    got = wait_subscribed(pub, sub)
    last = pub.publish([BlockStored([1, 2], None, [1, 2, 3, 4], 2), BlockRemoved([2])])
    live = VLLM_ARRAY_WIRE.decode(recv_through(sub, last, got)[-1][2])
    assert [type(e) for e in live.events] == [OldStored, OldRemoved]
    assert live.events[0].token_ids == [1, 2, 3, 4] and live.data_parallel_rank == 1
    with pytest.raises(msgspec.ValidationError):
        WIRE.decode(got[-1][2])  # not maps
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    replayed = request(dealer, last.to_bytes(8, "big"))
    assert VLLM_ARRAY_WIRE.decode(replayed[0][2]).events[1].block_hashes == [2]
    snap = request(dealer, b"SNAPSHOT")
    assert [e.block_hashes for e in VLLM_ARRAY_WIRE.decode(snap[0][2]).events] == [[1]]


def test_replay_from_middle_returns_later_batches_then_end(ctx, publisher):
    pub = publisher(topic="t")
    payloads = [[BlockStored([i + 1], i or None, [i], 1)] for i in range(20)]
    for events in payloads:
        pub.publish(events)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    replies = request(dealer, (7).to_bytes(8, "big"))
    assert replies[-1] == END
    assert [seq_of(m[1]) for m in replies[:-1]] == list(range(7, 20))
    assert all(m[0] == b"t" for m in replies[:-1])
    assert [WIRE.decode(m[2]).events[0].block_hashes for m in replies[:-1]] == [
        [i + 1] for i in range(7, 20)
    ]
    assert request(dealer, (20).to_bytes(8, "big")) == [END]


def test_replay_older_than_buffer_starts_at_oldest_kept(ctx, publisher):
    pub = publisher(buffer_steps=5)
    for i in range(12):
        pub.publish([BlockRemoved([i])])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    replies = request(dealer, (0).to_bytes(8, "big"))
    assert [seq_of(m[1]) for m in replies[:-1]] == [7, 8, 9, 10, 11]


def test_snapshot_then_live_reproduces_index(ctx, publisher):
    batches, expected = make_stream(seed=99, n_batches=80)
    pub = publisher()
    for events in batches[:50]:
        pub.publish(events)
    sub = sub_socket(ctx, pub.endpoint)
    got = wait_subscribed(pub, sub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    snap = request(dealer, b"SNAPSHOT")
    assert len(snap) == 2 and snap[1] == END
    snap_seq = seq_of(snap[0][1])
    assert snap_seq >= 50
    index: Index = {}
    snap_batch = WIRE.decode(snap[0][2])
    assert all(isinstance(ev, WStored) for ev in snap_batch.events)
    fold(index, snap_batch, parents_first=True)
    last = [pub.publish(events) for events in batches[50:]][-1]
    for msg in recv_through(sub, last, got):
        if seq_of(msg[1]) > snap_seq:
            fold(index, WIRE.decode(msg[2]))
    assert index == expected


def test_snapshot_of_empty_publisher(ctx, publisher):
    pub = publisher()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    snap = request(dealer, b"SNAPSHOT")
    assert seq_of(snap[0][1]) == -1 and WIRE.decode(snap[0][2]).events == []
    assert snap[1] == END


def test_publish_never_blocks_without_reader(ctx, publisher):
    pub = publisher(queue_size=100_000)
    start = time.perf_counter()
    for i in range(10_000):
        pub.publish([BlockRemoved([i])])
    no_subscriber_s = time.perf_counter() - start
    sub = sub_socket(ctx, pub.endpoint, hwm=1)
    wait_subscribed(pub, sub)  # then never read again
    start = time.perf_counter()
    for i in range(10_000):
        pub.publish([BlockRemoved([i])])
    stalled_reader_s = time.perf_counter() - start
    assert no_subscriber_s < 5.0 and stalled_reader_s < 5.0
    stats = pub.stats()
    assert stats.published_batches + stats.dropped_batches == pub.next_seq


def test_concurrent_publishers_keep_wire_order(ctx, publisher):
    pub = publisher()
    sub = sub_socket(ctx, pub.endpoint)
    got = wait_subscribed(pub, sub)

    def work(tid: int) -> None:
        for i in range(500):
            pub.publish([BlockRemoved([tid * 1000 + i])])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [seq_of(m[1]) for m in recv_through(sub, pub.next_seq - 1, got)]
    assert seqs == list(range(seqs[0], pub.next_seq))
    assert pub.stats().dropped_batches == 0


def test_full_queue_drops_are_counted_and_replayable(ctx, publisher):
    pub = publisher(queue_size=1, buffer_steps=10_000)
    start = time.perf_counter()
    seqs = [pub.publish([BlockRemoved([i])]) for i in range(5_000)]
    assert time.perf_counter() - start < 5.0
    assert seqs == list(range(5_000)), "a dropped batch must still use its number"
    stats = pub.stats()
    assert stats.dropped_batches > 0
    assert stats.dropped_events == stats.dropped_batches
    assert stats.published_batches + stats.dropped_batches == 5_000
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    replies = request(dealer, (0).to_bytes(8, "big"))
    assert [seq_of(m[1]) for m in replies[:-1]] == seqs


def test_bad_replay_request_is_ignored_and_counted(ctx, publisher):
    pub = publisher()
    pub.publish([AllBlocksCleared()])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send(b"\x00\x01\x02")
    dealer.send_multipart([(0).to_bytes(8, "big"), b"extra"])
    dealer.send(b"SNAPSHOT!")
    assert not dealer.poll(300), "an unparseable request got a reply"
    replies = request(dealer, (0).to_bytes(8, "big"))
    assert [seq_of(m[1]) for m in replies[:-1]] == [0]
    assert pub.stats().bad_requests == 3
    assert pub.publish([]) == 1


def test_ipc_endpoint_and_connect_mode(ctx, tmp_path):
    sock_dir = str(tmp_path)
    if len(sock_dir) > 90:  # a Unix socket path must stay under ~107 bytes
        sock_dir = tempfile.mkdtemp(prefix="tpev", dir="/tmp")
    with EventPublisher(EventConfig(endpoint=f"ipc://{sock_dir}/kv.sock")) as pub:
        sub = sub_socket(ctx, pub.endpoint)
        assert seq_of(wait_subscribed(pub, sub)[0][1]) >= 0
    # connect=True: the publisher connects, here to a SUB that binds.
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOOPBACK)
    cfg = EventConfig(endpoint=sub.get(zmq.LAST_ENDPOINT).decode(), connect=True)
    with EventPublisher(cfg) as pub:
        assert not pub.config.binds
        assert seq_of(wait_subscribed(pub, sub)[0][1]) >= 0


def test_invalid_endpoints_fail_at_start_up(ctx):
    taken = ctx.socket(zmq.ROUTER)
    taken.bind("tcp://*:*")
    port = taken.get(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
    with pytest.raises(EventPublisherError, match=r"endpoint.*in use"):
        EventPublisher(EventConfig(endpoint=f"tcp://*:{port}", insecure=True))
    with pytest.raises(EventPublisherError, match="replay_endpoint"):
        EventPublisher(
            EventConfig(endpoint=LOOPBACK, replay_endpoint=f"tcp://*:{port}", insecure=True)
        )
    with pytest.raises(EventPublisherError, match=r"256\.1\.1\.1"):
        EventPublisher(EventConfig(endpoint="tcp://256.1.1.1:*", insecure=True))
    with pytest.raises(EventPublisherError, match="No such file"):
        EventPublisher(EventConfig(endpoint="ipc:///nonexistent-dir/kv.sock"))
    if not zmq.has("pgm"):
        with pytest.raises(EventPublisherError, match="not supported"):
            EventPublisher(EventConfig(endpoint="pgm://eth0;239.1.1.1:5555", insecure=True))
    # A failed start holds nothing: once the other socket goes, the port can be had.
    taken.close(linger=0)
    deadline = time.monotonic() + WAIT_S
    while True:  # libzmq unbinds a closed socket asynchronously
        try:
            with EventPublisher(EventConfig(endpoint=f"tcp://*:{port}", insecure=True)) as pub:
                assert pub.endpoint.endswith(port)
            break
        except EventPublisherError:
            assert time.monotonic() < deadline, f"port {port} still taken"
            time.sleep(0.01)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"endpoint": ""}, "endpoint"),
        ({"endpoint": "127.0.0.1:5557"}, "endpoint"),
        ({"endpoint": "foo://x"}, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1"}, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1:70000"}, "endpoint"),
        ({"endpoint": "tcp://*:abc"}, "endpoint"),
        ({"replay_endpoint": "udpx://x:1"}, "replay_endpoint"),
        ({"replay_endpoint": "tcp://*:5557"}, "replay_endpoint"),
        ({"topic": b"kv"}, "topic"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"queue_size": -1}, "queue_size"),
        ({"queue_size": 1.5}, "queue_size"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
        ({"encoding": "json"}, "encoding"),
        ({"encoding": None}, "encoding"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(EventConfigError, match=f"EventConfig.{field}:") as err:
        EventConfig(**kwargs)
    assert err.value.field == field


def test_invalid_events_use_no_sequence_number_and_close_is_idempotent(publisher):
    pub = publisher()
    with pytest.raises(InvalidEventError, match="event 1"):
        pub.publish([AllBlocksCleared(), "BlockStored"])
    with pytest.raises(InvalidEventError, match="3 token ids"):
        pub.publish([BlockStored([1, 2], None, [1, 2, 3], 2)])
    with pytest.raises(InvalidEventError, match="64 bits"):
        pub.publish([BlockStored([1 << 64], None, [1], 1)])
    assert pub.publish([AllBlocksCleared()]) == 0
    pub.close()
    pub.close()
    with pytest.raises(EventPublisherError, match="closed"):
        pub.publish([])
