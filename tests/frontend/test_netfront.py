"""The network frontend and its torch-free client, on a TP=2 group of in-process
ranks (real gloo) and real ZMQ: typed replies, a request as one step, many client
processes at once, malformed frames, a client that disconnects mid-call, authentication
on a network address, a full queue, and row rewrites that reach the remote frontend."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from net_helpers import group, settled

from tpcache.cache.errors import UnknownRequest
from tpcache.client import NetworkClient
from tpcache.frontend import api
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig, FrontendConfigError, owner_of
from tpcache.frontend.owners import scoped_id


@pytest.fixture()
def served():
    coord = group()
    lock = threading.Lock()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), lock)
    yield coord, front, lock
    front.close()
    coord.close()


def test_calls_replies_and_typed_errors(served) -> None:
    coord, front, lock = served
    with NetworkClient(front.endpoint) as c:
        got = c.admit("a", list(range(1, 30)))
        assert got.prefix_len == 0 and len(got.slots) == 29
        assert len(c.extend("a", 3).slots) == 3
        assert c.finish("a", [7, 7, 7]).cached_tokens == 32
        again = c.admit("b", [*range(1, 30), 7, 7, 7, 1])
        assert again.prefix_len == 32
        with pytest.raises(UnknownRequest):
            c.finish("nobody")
        c.abort("b")
        own = c.stats()  # a network client's own figures, not the group's
        assert (own["scope"], own["queries"], own["query_tokens"]) == ("client", 2, 29 + 33)
        assert own["hit_tokens"] == 32 and "running" not in own
    assert coord.stats()["running"] == 0
    digest, ranks = settled(coord, lock)
    assert ranks == [digest, digest]


def test_a_request_is_one_step(served) -> None:
    coord, front, _ = served
    with NetworkClient(front.endpoint) as c:
        before = coord.stats()["steps_sent"]
        with c.batch() as b:
            p = [b.admit(f"r{i}", [*range(100, 140), i]) for i in range(8)]
            bad = b.finish("missing")
            f = [b.finish(f"r{i}") for i in range(8)]
        # Nothing was cached before the step, and its admits come before its finishes.
        assert [x.result().prefix_len for x in p] == [0] * 8
        with pytest.raises(UnknownRequest):
            bad.result()
        assert all(x.result().cached_tokens == 40 for x in f)
        assert coord.stats()["steps_sent"] == before + 1


def _client_proc(endpoint: str, who: int, n: int, out) -> None:
    from tpcache.client import NetworkClient

    t0 = time.perf_counter()
    with NetworkClient(endpoint) as c:
        for i in range(n):
            rid = f"p{who}-{i}"
            c.admit(rid, [1 + who, *range(2, 50), i % 7])
            c.extend(rid, 2)
            c.finish(rid, [9, 9])
    out.put((who, 3 * n / (time.perf_counter() - t0)))


def test_many_client_processes_leave_every_rank_equal(served) -> None:
    coord, front, lock = served
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(front.endpoint, w, 40, q)) for w in range(8)]
    for p in procs:
        p.start()
    rates = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    print(f"per-client calls/s: {sorted(round(r) for r in rates.values())}; steps {front.steps}")
    digest, ranks = settled(coord, lock)
    assert ranks == [digest, digest]
    with lock:
        s = coord.mirror.sizes()
        assert s.held == 0 and s.protected == 0  # nothing leaked
        assert coord.stats()["divergences"] == 0


def test_malformed_frames_and_a_client_that_leaves_mid_call(served) -> None:
    coord, front, lock = served
    before = settled(coord, lock)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    session = b"s" + os.urandom(16)  # its routing id: who it is to the frontend
    s.setsockopt(zmq.ROUTING_ID, session)
    s.connect(front.endpoint)
    rid = b"\0" * 8
    cases = [
        [rid, b"", b"\xc1"],  # not msgpack
        [rid, b"", msgspec.msgpack.encode([{"call": "warp"}])],
        [rid, b"", msgspec.msgpack.encode([])],  # no calls
    ]
    for frames in cases:
        s.send_multipart(frames)
        assert s.poll(10_000)
        _, body = s.recv_multipart()
        (reply,) = api.decode_replies(body)
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest", reply
    # Larger than any valid request: ZMQ drops the connection before holding it (no
    # reply); the socket reconnects by itself.
    s.send_multipart([rid, b"", b"\x91" + b"\x00" * (40 << 20)])
    assert not s.poll(1000)
    s.send_multipart([b"short", b"", b"x"])  # not the protocol: no reply, no harm
    s.send_multipart([rid, b"", b"\x91", *[b"extra"] * 1000])  # frames too many: dropped
    s.send_multipart([b"x"])
    assert not s.poll(300)
    # A client that sends a request and goes before the reply: applied, nobody answered.
    s.send_multipart([rid, b"", api.encode_calls([api.AdmitCall("gone", [1, 2, 3])])])
    s.close(0)
    ctx.term()
    time.sleep(0.3)
    assert coord.stats()["running"] == 1  # the malformed ones changed nothing; this applied
    with NetworkClient(front.endpoint) as c, pytest.raises(UnknownRequest):
        c.abort("gone")  # another client's request is not this one's to touch
    with NetworkClient(front.endpoint, session=session) as c:
        c.abort("gone")  # its owner, back with its session, cleans up
    assert coord.stats()["held"] == 0
    digest, ranks = settled(coord, lock)
    assert ranks == [digest, digest] and digest != before[0]
    assert front.refused >= 4


def test_a_network_address_needs_curve_or_a_token() -> None:
    with pytest.raises(FrontendConfigError, match="network"):
        FrontendConfig(endpoint="tcp://0.0.0.0:5999")
    with pytest.raises(FrontendConfigError, match="token"):
        FrontendConfig(endpoint="tcp://0.0.0.0:5999", token="short")
    coord = group()
    token = os.urandom(16).hex()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://0.0.0.0:*", token=token))
    port = front.endpoint.rsplit(":", 1)[1]
    try:
        d0 = coord.mirror.digest()
        with NetworkClient(f"tcp://127.0.0.1:{port}") as anon:
            from tpcache.frontend.api import Unauthenticated

            with pytest.raises(Unauthenticated):
                anon.admit("x", [1, 2, 3])
        with (
            NetworkClient(f"tcp://127.0.0.1:{port}", token="wrong" * 8) as wrong,
            pytest.raises(Unauthenticated),
        ):
            wrong.admit("x", [1, 2, 3])
        assert coord.mirror.digest() == d0  # nothing changed
        with NetworkClient(f"tcp://127.0.0.1:{port}", token=token) as ok:
            assert ok.admit("x", [1, 2, 3]).prefix_len == 0
            ok.abort("x")
    finally:
        front.close()
        coord.close()


def test_a_full_queue_answers_busy_at_once() -> None:
    coord = group()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*", max_queue=4))
    try:
        with NetworkClient(front.endpoint) as c:
            replies = c.send([api.AdmitCall(f"q{i}", [1, 2, 3, i]) for i in range(5)])
            assert [type(r).__name__ for r in replies] == ["ErrorReply"] * 5
            assert replies[0].error == "Busy" and replies[0].retryable
            assert coord.stats()["running"] == 0  # none of it applied
            assert len(c.send([api.AdmitCall("fits", [1, 2, 3])])) == 1
            c.abort("fits")
    finally:
        front.close()
        coord.close()


def test_row_rewrites_reach_the_remote_frontend(served) -> None:
    """Chunked prefill of two requests with the same prompt: when B caches its first
    chunk, the tree already holds A's pages, so B's row is rewritten to them and its own
    pages freed. The reply says so, and the frontend's row equals the ranks'."""
    coord, front, lock = served
    prompt = list(range(500, 540))
    with NetworkClient(front.endpoint) as c:
        rows: dict[str, list[int]] = {}
        for rid in ("A", "B"):
            rows[rid] = c.admit(rid, prompt[:8]).slots
        for rid in ("A", "B"):
            rows[rid] += c.extend(rid, 16).slots
            got = c.cache_unfinished(rid, prompt[:24])
            assert got.cached_tokens == 24
            if got.row:
                assert set(got.freed) <= set(rows[rid]) and not set(got.freed) & set(got.row)
                rows[rid] = got.row
        assert rows["A"][:24] == rows["B"][:24]  # B now reads A's KV
        with lock:
            coord.sync()
            for rid in ("A", "B"):
                known_as = scoped_id(owner_of("", c.session), rid)  # the cache's name for it
                assert coord.ranks.call("request_slots", known_as) == [rows[rid]] * 2
        c.finish("A")
        c.finish("B")


def _check_swa(coord, rid: str, start: int, reply) -> None:
    """The reply's SWA slots are those of the request's full slots from the window before
    ``start`` to the end of its row, as the cache maps them."""
    row = coord.mirror.request_row(rid)
    assert reply.swa_start == max(0, start - 12)
    full = row.slots[reply.swa_start :]
    assert reply.swa_slots == coord.mirror.swa.slots(full).tolist()
    assert len(set(reply.swa_slots)) == len(reply.swa_slots) == row.num_tokens - reply.swa_start


def test_hybrid_replies_carry_the_swa_slots() -> None:
    """#21: with the sliding-window cache, admit, extend and a rewriting cache_unfinished
    give the SWA slots the new tokens read (the window before them) and write; with the
    full-attention cache they give none."""
    coord = group(window=12)
    lock = threading.Lock()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), lock)
    prompt = list(range(600, 640))
    try:
        with NetworkClient(front.endpoint) as c:
            c.admit("warm", prompt[:32])
            c.finish("warm")
            got = c.admit("A", prompt)  # a hit of 32 tokens: reads the window 20..32
            assert got.prefix_len == 32 and got.swa_start == 20
            own = owner_of("", c.session)  # the cache knows its requests by scoped ids
            with lock:
                _check_swa(coord, scoped_id(own, "A"), 32, got)
            more = c.extend("A", 5)
            with lock:
                _check_swa(coord, scoped_id(own, "A"), 40, more)
            c.admit("B", prompt[:8])
            c.extend("B", 16)
            c.admit("C", prompt[:8])
            c.extend("C", 16)
            c.cache_unfinished("B", prompt[:24])
            moved = c.cache_unfinished("C", prompt[:24])  # rewritten to B's pages
            assert moved.row
            with lock:
                _check_swa(coord, scoped_id(own, "C"), 24, moved)
            for rid in ("A", "B", "C"):
                c.abort(rid)
        digest, ranks = settled(coord, lock)
        assert ranks == [digest, digest]
    finally:
        front.close()
        coord.close()


def test_full_attention_replies_have_no_swa_slots(served) -> None:
    _, front, _ = served
    with NetworkClient(front.endpoint) as c:
        got = c.admit("a", list(range(1, 30)))
        more = c.extend("a", 2)
        assert (got.swa_start, got.swa_slots, more.swa_start, more.swa_slots) == (0, [], 0, [])
        c.abort("a")


def test_the_client_imports_neither_torch_nor_ray() -> None:
    code = "import sys, tpcache.client; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
