"""What a router built on vLLM reads from tpcache's KV events, over real ZMQ sockets.

The decoders (``vllm_wire``) are written from vLLM's own structs, not from tpcache's
classes; the replay sockets are driven as vLLM's subscribers drive them (a REQ socket
that sends the start sequence as 8 bytes big-endian, a DEALER with the REQ envelope).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from ns_helpers import run_in
from swa_helpers import hybrid
from vllm_wire import VLLM_ARRAY_WIRE, VLLM_WIRE, OldStored, VRemoved, VStored

from tpcache.cache.errors import UnknownName
from tpcache.cache.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from tpcache.cache.factory import CacheSpec
from tpcache.cache.namespace import CacheNamespace
from tpcache.events.event_config import EventConfig, EventConfigError
from tpcache.events.publisher import EventPublisher
from tpcache.events.replay_server import BAD_SEQ

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_MS = 5000
END = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


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
        pub = EventPublisher(EventConfig(**kw))
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


def live(ctx: zmq.Context, pub: EventPublisher, batches: list[list]) -> list[list[bytes]]:
    """Subscribe, publish ``batches`` once the subscription is through, read them."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    while True:  # probes until the subscription is through (PUB drops before it)
        seq = pub.publish([])
        if sub.poll(50):
            got = sub.recv_multipart()
            if int.from_bytes(got[1], "big") == seq:
                break
    last = [pub.publish(b) for b in batches][-1]
    out: list[list[bytes]] = []
    while not out or int.from_bytes(out[-1][1], "big") != last:
        assert sub.poll(WAIT_MS), "a live batch did not come"
        msg = sub.recv_multipart()
        if msg[2] and msgspec.msgpack.decode(msg[2])[1]:  # skip the empty probes
            out.append(msg)
    sub.close(linger=0)
    return out


def namespaced_events() -> list:
    """A page-2 cache's events: a default-namespace prefix, the same tokens under a LoRA
    adapter and under a salt, one eviction."""
    cache = CacheSpec(page_size=2).build(64, record_events=True)
    run_in(cache, 0, [1, 2, 3, 4, 5])
    run_in(cache, 1, [1, 2, 3, 4, 5], CacheNamespace(lora_id=3, lora_name="sql"))
    run_in(cache, 2, [1, 2, 3, 4, 5], CacheNamespace(salt="tenant-a"))
    cache.evict(2)
    return cache.take_events()


def test_default_encoding_is_what_current_vllm_decodes(ctx, publisher):
    events = namespaced_events()
    pub = publisher(topic="kv", data_parallel_rank=2)
    (msg,) = live(ctx, pub, [events])
    assert msg[0] == b"kv" and len(msg) == 3
    batch = VLLM_WIRE.decode(msg[2])
    assert batch.data_parallel_rank == 2
    assert [type(e) for e in batch.events] == [VStored, VStored, VStored, VRemoved]
    plain, lora, salted, removed = batch.events
    assert plain.token_ids == lora.token_ids == salted.token_ids == [1, 2, 3, 4]
    assert (lora.lora_id, lora.lora_name) == (3, "sql")
    assert (salted.lora_id, salted.lora_name) == (None, None)
    # Same tokens, three hash chains; vLLM's optional fields stay unset.
    assert len({plain.block_hashes[0], lora.block_hashes[0], salted.block_hashes[0]}) == 3
    assert plain.extra_keys is None and plain.group_idx is None
    assert removed.block_hashes == plain.block_hashes  # the least recently used
    # The namespace extension, which vLLM's decoder skipped: on namespaced blocks only,
    # one id per namespace, and the salt nowhere in the bytes.
    raw = msgspec.msgpack.decode(msg[2])[1]
    marks = [e.get("namespace") for e in raw[:3]]
    assert marks[0] is None and "namespace" not in raw[0]
    assert marks[1] != marks[2] and all(len(m) == 16 for m in marks[1:])
    assert b"tenant-a" not in msg[2]
    assert {"lora_id", "medium", "lora_name"} <= set(raw[0])  # vLLM requires them


def test_array_encoding_is_what_vllm_up_to_0_23_decodes(ctx, publisher):
    events = namespaced_events()
    pub = publisher(encoding="array")
    (msg,) = live(ctx, pub, [events])
    old = VLLM_ARRAY_WIRE.decode(msg[2])
    assert [type(e) for e in old.events[:3]] == [OldStored] * 3
    assert (old.events[1].lora_id, old.events[1].token_ids) == (3, [1, 2, 3, 4])
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        VLLM_WIRE.decode(msg[2])  # what current vLLM says of the older form
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        VLLM_ARRAY_WIRE.decode(encode_batch(KVEventBatch(1.0, events)))


def test_a_req_socket_reads_a_replay_one_batch_a_request_to_the_end_frame(ctx, publisher):
    pub = publisher(topic="kv")
    for i in range(4):
        pub.publish([BlockStored([i + 1], i or None, [i, i], 2)])
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    got, start = [], 1
    while True:
        req.send(seq_bytes(start))
        assert req.poll(WAIT_MS), "no answer to a REQ"
        frames = req.recv_multipart()
        if frames == [b"", END, b""]:
            break
        topic, seq, payload = frames
        assert topic == b"kv"
        got.append(int.from_bytes(seq, "big"))
        assert VLLM_WIRE.decode(payload).events[0].block_hashes == [got[-1] + 1]
        start = got[-1] + 1
    assert got == [1, 2, 3]
    assert pub.stats().replay_requests == 4


def test_a_dealer_in_vllms_framing_reads_the_whole_replay(ctx, publisher):
    for encoding, head, end in (
        ("map", [b"", b"t"], [b"", b"", END, b""]),
        ("array", [b""], [b"", END, b""]),
    ):
        pub = publisher(topic="t", encoding=encoding)
        for i in range(3):
            pub.publish([BlockRemoved([i])])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", seq_bytes(0)])
        replies = []
        while not replies or replies[-1] != end:
            assert dealer.poll(WAIT_MS), f"{encoding}: no end frame"
            replies.append(dealer.recv_multipart())
        assert [r[: len(head)] for r in replies[:-1]] == [head] * 3
        seqs = [int.from_bytes(r[len(head)], "big") for r in replies[:-1]]
        assert seqs == [0, 1, 2]
        wire = VLLM_WIRE if encoding == "map" else VLLM_ARRAY_WIRE
        assert wire.decode(replies[1][-1]).events[0].block_hashes == [1]
        dealer.close(linger=0)


def test_bad_replay_requests_in_vllms_framing_get_a_defined_answer(ctx, publisher):
    pub = publisher()
    pub.publish([BlockRemoved([7])])
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    bad = [b"", BAD_SEQ.to_bytes(8, "big", signed=True), b""]
    for body in (b"\x00\x01\x02", b"", b"SNAPSHOT!"):
        req.send(body)
        assert req.poll(WAIT_MS), f"no answer to {body!r}"
        assert req.recv_multipart() == bad
    # A snapshot is tpcache's own framing only: here SNAPSHOT is a (huge) start sequence.
    req.send(b"SNAPSHOT")
    assert req.poll(WAIT_MS) and req.recv_multipart() == [b"", END, b""]
    req.send(seq_bytes(0))
    assert req.poll(WAIT_MS) and int.from_bytes(req.recv_multipart()[1], "big") == 0
    assert pub.stats().bad_requests == 3
    # tpcache's own framing still has its snapshot, told apart by the missing delimiter.
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send(b"SNAPSHOT")
    assert dealer.poll(WAIT_MS)
    assert int.from_bytes(dealer.recv_multipart()[1], "big", signed=True) == 0
    dealer.close(linger=0)


def test_sliding_window_kv_lost_under_a_tombstone_is_announced(ctx, publisher):
    """A router that folds the stream counts no block a match could not end in."""
    c = hybrid(64, 64, window=4)
    c.admit("a", list(range(1, 11)))
    c.finish("a")
    c.admit("b", [*range(1, 7), *range(20, 24)])
    c.finish("b")
    held = c.match_prefix(list(range(1, 11))).handle
    c.lock(held)  # SWA-locks [7..10] only: [1..6] can lose its SWA KV
    c.match_prefix([*range(1, 7), *range(20, 24)])  # [20..23] used after [1..6]
    assert c.evict(0, 1).tombstoned == 1
    c.unlock(held)
    (tomb,) = [n for n in c.tree.walk() if n.tombstone]
    revived = [*range(1, 7), 30, 31, 32, 33]
    c.admit("c", revived)
    c.finish("c")  # gives [1..6] its SWA KV again
    pub = publisher()
    msgs = live(ctx, pub, [c.take_events()])
    router: dict[int, list[int]] = {}
    removed: list[list[int]] = []
    for msg in msgs:
        for ev in VLLM_WIRE.decode(msg[2]).events:
            if isinstance(ev, VStored):
                for h in ev.block_hashes:
                    router[h] = ev.token_ids
            elif isinstance(ev, VRemoved):
                removed.append(ev.block_hashes)
                for h in ev.block_hashes:
                    router.pop(h, None)
    tomb_hashes = [h for h in router if h in set(removed[0])]
    assert len(removed) == 1 and len(removed[0]) == 6  # the tombstone's six blocks
    assert sorted(tomb_hashes) == sorted(removed[0])  # stored again on revival
    assert c.match_prefix(revived).prefix_len == len(revived)
    assert not tomb.tombstone


def test_unknown_encoding_is_refused_before_any_socket(ctx):
    with pytest.raises(EventConfigError, match="encoding") as err:
        EventConfig(endpoint=LOOPBACK, encoding="json")
    assert err.value.field == "encoding"
    with pytest.raises(UnknownName, match="unknown event encoding 'json'"):
        encode_batch(KVEventBatch(1.0, []), "json")


def test_public_endpoint_error_names_fields_and_serve_flags():
    with pytest.raises(EventConfigError) as err:
        EventConfig(endpoint="tcp://0.0.0.0:5557")
    text = str(err.value)
    for name in (
        "curve_secret_key",
        "--events-curve-secret-file",
        "insecure=True",
        "--events-insecure",
    ):
        assert name in text, name
    with pytest.raises(EventConfigError, match="--events-insecure"):
        EventConfig(endpoint="tcp://10.1.2.3:5557", connect=True, curve_secret_key=None)
