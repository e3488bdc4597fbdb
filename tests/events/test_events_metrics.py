"""KV events on the wire and Prometheus metrics, end to end through a TP=2 group."""

from __future__ import annotations

import random
import time
import urllib.request

import msgspec
import pytest
import zmq

from tpcache.cache.blocks import cached_blocks
from tpcache.events.event_config import EventConfig, EventConfigError
from tpcache.frontend.service import GroupConfig, start_group
from tpcache.workers.rank import CacheSpec


# The subscriber's own structs, written from the wire spec (not tpcache's classes).
class WStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class WRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None


class WCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class WBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[WStored | WRemoved | WCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(WBatch)


def fold(index: dict, batch: WBatch, removed_unknown: list) -> None:
    for ev in batch.events:
        if isinstance(ev, WStored):
            parent = ev.parent_block_hash
            bs = ev.block_size
            for i, h in enumerate(ev.block_hashes):
                index[h] = (parent, tuple(ev.token_ids[i * bs : (i + 1) * bs]))
                parent = h
        elif isinstance(ev, WRemoved):
            for h in ev.block_hashes:
                if h not in index:
                    removed_unknown.append(h)
                index.pop(h, None)
        else:
            index.clear()


def drive(coord, seed: int, n: int = 80) -> None:
    rng = random.Random(seed)
    print(f"seed={seed}")
    stems = [[rng.randrange(1, 300) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    for i in range(n):
        prompt = rng.choice(stems) + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 30))]
        coord.admit(i, prompt)
        coord.extend(i, 4)
        coord.finish(i, [rng.randrange(1, 300) for _ in range(4)])
    coord.sync()


@pytest.fixture
def group(ray_cluster, tmp_path):
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=512,
        cache=CacheSpec(page_size=4),
        num_layers=1,
        kv_heads=2,
        head_dim=2,
        dtype="float32",
        cpu_budget_bytes=1 << 20,
        timeout_s=20.0,
        events=EventConfig(
            endpoint=f"ipc://{tmp_path}/ev.sock",
            replay_endpoint=f"ipc://{tmp_path}/replay.sock",
            topic="tp",
        ),
        metrics_port=0,
    )
    coord = start_group(cfg)
    yield coord
    coord.close()


def recv_all(sock, until_seq: int, timeout: float = 20.0) -> list[tuple[int, WBatch]]:
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sock.poll(200):
            if got and got[-1][0] >= until_seq:
                break
            continue
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"tp"
        got.append((int.from_bytes(seq, "big", signed=True), DECODE.decode(payload)))
        if got[-1][0] >= until_seq:
            break
    return got


def test_router_index_equals_cached_blocks(group, tmp_path):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"tp")
    sub.connect(group.publisher.endpoint)
    # Slow joiner: empty probe batches until the SUB gets one, rather than a fixed
    # sleep that a loaded machine may outlast. What it missed holds no events.
    first = None
    deadline = time.monotonic() + 20
    while first is None:
        assert time.monotonic() < deadline, "the subscriber never connected"
        group.publisher.publish([])
        if sub.poll(50):
            _, seq, payload = sub.recv_multipart()
            first = (int.from_bytes(seq, "big", signed=True), DECODE.decode(payload))
    drive(group, seed=7)
    assert group.stats()["evicted_tokens"] > 0  # removals were exercised
    last = group.publisher.next_seq - 1
    live = [first, *recv_all(sub, last)]
    seqs = [s for s, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] == last  # no gaps
    index: dict = {}
    unknown: list = []
    for _, batch in live:
        fold(index, batch, unknown)
    assert unknown == []  # every removal names a hash seen stored
    expect = cached_blocks(group.mirror)
    assert index == expect
    assert len(expect) > 10

    # replay from the middle: exactly the later batches, then the end marker
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(group.publisher.replay_endpoint)
    mid = last // 2
    dealer.send((mid).to_bytes(8, "big"))
    replayed = []
    while True:
        assert dealer.poll(5000)
        topic, seq, payload = dealer.recv_multipart()
        s = int.from_bytes(seq, "big", signed=True)
        if s == -1:
            assert payload == b"" and topic == b""
            break
        replayed.append((s, payload))
    assert [s for s, _ in replayed] == list(range(mid, last + 1))
    assert [DECODE.decode(p) for _, p in replayed] == [b for s, b in live if s >= mid]

    # snapshot + later live events reproduce the index
    dealer.send(b"SNAPSHOT")
    assert dealer.poll(5000)
    _, seq, payload = dealer.recv_multipart()
    snap_seq = int.from_bytes(seq, "big", signed=True)
    assert snap_seq == last
    snap_index: dict = {}
    fold(snap_index, DECODE.decode(payload), unknown)
    _, end, _ = dealer.recv_multipart()
    assert int.from_bytes(end, "big", signed=True) == -1
    assert snap_index == expect
    group.admit("late", list(range(500, 540)))
    group.finish("late", [1, 2, 3, 4])
    group.sync()
    for _, batch in recv_all(sub, group.publisher.next_seq - 1):
        fold(snap_index, batch, unknown)
    assert snap_index == cached_blocks(group.mirror)
    sub.close(0)
    dealer.close(0)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_agree_with_stats(group):
    drive(group, seed=11, n=40)
    stats = group.stats()
    m = scrape(group.metrics_port)
    assert m["tpcache_prefix_queries_total"] == stats["queries"] == 40
    assert m["tpcache_prefix_hit_tokens_total"] == stats["hit_tokens"] > 0
    assert m["tpcache_prefix_query_tokens_total"] == stats["query_tokens"]
    assert m["tpcache_evicted_tokens_total"] == stats["evicted_tokens"]
    assert m["tpcache_steps_total"] == stats["steps_done"] == stats["steps_sent"]
    assert 0 < m["tpcache_rank_messages_total"] == stats["messages_sent"] <= stats["steps_sent"]
    assert m["tpcache_steps_waiting"] == stats["waiting"] == 0
    assert m["tpcache_divergences_total"] == 0
    assert m["tpcache_pool_capacity_tokens"] == stats["capacity"] == 512
    assert m["tpcache_pool_free_tokens"] == stats["free"]
    assert m["tpcache_cache_evictable_tokens"] == stats["evictable"]
    assert m["tpcache_cache_protected_tokens"] == stats["protected"]
    assert m["tpcache_kv_events_published_total"] == stats["events_published"] > 0
    assert m["tpcache_kv_events_dropped_total"] == stats["events_dropped"] == 0
    assert m["tpcache_step_latency_seconds_count"] == stats["steps_done"]
    assert m["tpcache_evict_seconds_count"] > 0
    assert abs(m["tpcache_prefix_hit_rate"] - stats["hit_rate"]) < 1e-12
    # No host tier here: no host series, no host keys.
    assert not [k for k in m if k.startswith("tpcache_host_")]
    assert not [k for k in stats if k.startswith("host_")]


def test_bad_events_endpoint_fails_at_start(ray_cluster):
    from tpcache.events.publisher import EventPublisherError

    with pytest.raises(EventConfigError):
        EventConfig(endpoint="nonsense")
    with pytest.raises(EventConfigError):
        EventConfig(endpoint="tcp://*:70000")
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = GroupConfig(tp=2, events=EventConfig(endpoint=f"tcp://127.0.0.1:{port}"))
        t = time.monotonic()
        with pytest.raises(EventPublisherError, match=str(port)):
            start_group(cfg).close()
        assert time.monotonic() - t < 5  # before any rank started
    finally:
        taken.close(0)
