"""The reference subscriber, its BlockIndex, and the ``tpcache events`` command."""

from __future__ import annotations

import argparse
import io
import json
import time

import pytest

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from tpcache.cli.events import build_events_parser, run_events
from tpcache.events.block_index import IndexIntegrityError, StoredBlock
from tpcache.events.publisher import EventConfig, EventPublisher
from tpcache.events.subscriber import (
    BlockIndex,
    EventSubscriber,
    EventSubscriberError,
    ProblemKind,
)

LOOPBACK = "tcp://127.0.0.1:*"


def stored(hashes, parent=None, size=2, medium="GPU", lora_id=None):
    tokens = [h % 100 for h in hashes for _ in range(size)]
    return BlockStored(hashes, parent, tokens, size, lora_id=lora_id, medium=medium)


def test_block_index_reports_problems_and_still_applies():
    idx = BlockIndex()
    assert idx.apply(stored([1, 2])) == []
    kinds = [p.kind for p in idx.apply(stored([3], parent=9))]
    assert kinds == [ProblemKind.UNKNOWN_PARENT] and (("GPU", 3) in idx)
    assert [p.kind for p in idx.apply(stored([2], parent=1))] == [ProblemKind.DUPLICATE_STORE]
    problems = idx.apply(BlockRemoved([2, 7]))
    assert [(p.kind, p.block_hash) for p in problems] == [(ProblemKind.UNKNOWN_REMOVAL, 7)]
    # The same hash on the other medium is another copy.
    assert [p.kind for p in idx.apply(BlockRemoved([1], medium="CPU"))] == [
        ProblemKind.UNKNOWN_REMOVAL
    ]
    bad = BlockStored([5, 6], None, [1, 2, 3], 2)
    assert [p.kind for p in idx.apply(bad)] == [ProblemKind.BAD_TOKEN_COUNT]
    with pytest.raises(IndexIntegrityError, match="block 6"):
        idx.check_integrity()
    idx.apply(AllBlocksCleared())
    assert len(idx) == 0
    with pytest.raises(TypeError):
        idx.apply("not an event")  # type: ignore[arg-type]


def test_block_index_snapshot_events_rebuild_it_parents_first():
    idx = BlockIndex()
    idx.apply_all(
        [
            stored([1, 2, 3]),
            stored([4, 5], parent=3),  # 3 -> 4 -> 5 extends the chain run
            stored([6], parent=3),  # a branch at 3 ends the run there
            stored([7, 8], parent=2, lora_id=1),  # other LoRA: its own run
            stored([1, 2], medium="CPU"),
            stored([10], parent=99),  # orphan: parent not stored
        ]
    )
    events = idx.to_events()
    assert [e.block_hashes for e in events] == [[1, 2], [3], [4, 5], [6], [7, 8], [1, 2], [10]]
    rebuilt = BlockIndex()
    problems = rebuilt.apply_all(events)
    assert [(p.kind, p.block_hash) for p in problems] == [(ProblemKind.UNKNOWN_PARENT, 99)]
    keys = idx.keys()
    assert rebuilt.keys() == keys
    assert all(rebuilt.get(h, m) == idx.get(h, m) for m, h in keys)
    assert rebuilt.get(8) == StoredBlock(7, (8, 8), 2, 1, None)


def test_block_index_integrity_catches_a_parent_cycle():
    idx = BlockIndex()
    idx.apply_all([stored([1]), stored([2], parent=1)])
    idx.check_integrity()
    # Block 1 stored again under its own child (a hash collision upstream): the index
    # applies it, as it applies every duplicate, and so holds the loop 1 -> 2 -> 1.
    again = idx.apply(stored([1], parent=2))
    assert [(p.kind, p.block_hash) for p in again] == [(ProblemKind.DUPLICATE_STORE, 1)]
    assert idx.get(1) == StoredBlock(2, (1, 1), 2, None, None)
    with pytest.raises(IndexIntegrityError, match="cycle"):
        idx.check_integrity()
    assert sorted(h for e in idx.to_events() for h in e.block_hashes) == [1, 2]


@pytest.fixture
def pub():
    cfg = EventConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv")
    with EventPublisher(cfg) as publisher:
        yield publisher


def wait_sent(pub: EventPublisher, n: int) -> None:
    """Until the send thread handed ``n`` batches to the PUB socket.

    A SUB that connects before then receives them live, which the gap test must avoid.
    """
    deadline = time.monotonic() + 5
    while pub.stats().sent_batches < n:
        assert time.monotonic() < deadline, "the publisher's send thread is stuck"
        time.sleep(0.005)


def test_subscriber_orders_dedups_and_fills_gaps_by_replay(pub):
    for i in range(5):
        pub.publish([stored([i + 1], parent=i or None)])
    wait_sent(pub, 5)
    with EventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv") as sub:
        assert [s for s, _ in sub.request_replay(0)] == [0, 1, 2, 3, 4]
        assert sub.last_seq == 4
        sub.last_seq = 1  # as if 2.. had been missed: the first live batch is past a gap
        deadline = time.monotonic() + 5
        seen: list[int] = []
        while len(seen) < 6 and time.monotonic() < deadline:
            pub.publish([])
            got = sub.next_batch(timeout=0.02)
            if got is not None:
                seen.append(got[0])
        while len(seen) < 12 and (got := sub.next_batch(timeout=0.5)) is not None:
            seen.append(got[0])
        assert seen == list(range(2, 2 + len(seen))) and len(seen) >= 6
        assert sub.gaps == 0
        assert pub.stats().replay_requests == 2


def test_subscriber_snapshot_and_errors(pub):
    pub.publish([stored([1, 2])])
    pub.publish([BlockRemoved([2])])
    with EventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        seq, batch = sub.request_snapshot()
        assert seq == 1 and sub.last_seq == 1
        assert batch.events == [stored([1])]
    with EventSubscriber(pub.endpoint) as sub, pytest.raises(EventSubscriberError, match="no"):
        sub.request_replay(0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(EventSubscriberError, match="replay_timeout"):
            EventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout=bad)


def test_subscriber_reads_the_array_encoding_too():
    cfg = EventConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, encoding="array")
    with EventPublisher(cfg) as pub:
        pub.publish([stored([1, 2])])
        pub.publish([BlockRemoved([2]), AllBlocksCleared()])
        with EventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            got = sub.request_replay(0)
            assert [b.events for _, b in got] == [
                [stored([1, 2])],
                [BlockRemoved([2]), AllBlocksCleared()],
            ]
            seq, snap = sub.request_snapshot()
            assert seq == 1 and snap.events == []  # cleared


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    build_events_parser(p)
    return p.parse_args(argv)


def test_events_cli_prints_replay_and_snapshot(pub):
    pub.publish([stored([1, 2]), BlockRemoved([2])])
    pub.publish([AllBlocksCleared()])
    base = ["--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--topic", "kv"]
    out = io.StringIO()
    assert run_events(parse(*base, "--from-seq", "0", "--count", "2"), out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("seq=0 ts=")
    assert lines[0].endswith("BlockStored=1 BlockRemoved=1 AllBlocksCleared=0")
    assert lines[1].endswith("BlockStored=0 BlockRemoved=0 AllBlocksCleared=1")
    out = io.StringIO()
    assert run_events(parse(*base, "--from-seq", "1", "--json", "--count", "1"), out) == 0
    record = json.loads(out.getvalue())
    assert record["seq"] == 1 and record["type"] == "AllBlocksCleared"
    out = io.StringIO()
    args = parse(*base, "--snapshot", "--json", "--count", "3", "--timeout", "0.2")
    assert run_events(args, out) == 1  # a snapshot (no events) then nothing new
    assert out.getvalue() == ""
    assert run_events(parse("--snapshot"), out) == 2
    assert run_events(parse(*base, "--replay-timeout", "0"), out) == 2
