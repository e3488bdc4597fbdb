"""Network clients kept apart: request ids scoped to the client that admitted them, cache
salts bound to a tenant's credential, stats that show a client its own figures only, a
request sent again answered instead of applied twice, a whole-request refusal typed in a
batch, and receive limits that keep a hostile client from making the server hold more
than one request. A TP=2 group of in-process ranks (real gloo), real ZMQ on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from group_helpers import group_config

from tpcache.cache.errors import DuplicateRequest, UnknownRequest
from tpcache.client import NetworkClient
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.frontend import api
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig, FrontendConfigError, owner_of
from tpcache.frontend.owners import scoped_id
from tpcache.workers.spec import CacheSpec

TOKEN_A = "a" * 20
TOKEN_B = "b" * 20


@pytest.fixture(scope="module")
def coord():
    cfg = group_config(
        2, capacity_tokens=4096, cache=CacheSpec(page_size=4, max_request_tokens=1024)
    )
    c = start_local_group(cfg)
    yield c
    c.close()


@pytest.fixture()
def front(coord):
    f = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"))
    yield f
    f.close()
    coord.reset()


def settled(coord) -> None:
    coord.sync()
    coord.mirror.check_integrity()
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2


def test_another_clients_request_is_unknown(coord, front) -> None:
    prompt = list(range(1, 30))
    with NetworkClient(front.endpoint) as a, NetworkClient(front.endpoint) as b:
        a.admit("r1", prompt)
        # B cannot learn that A's id runs, nor extend, finish or abort it: it is unknown,
        # word for word as an id nobody ever used.
        never = _error(lambda: b.extend("never-used", 1))
        for call in (
            lambda: b.extend("r1", 1),
            lambda: b.finish("r1", [5, 5, 5]),
            lambda: b.abort("r1"),
            lambda: b.cache_unfinished("r1", prompt),
        ):
            err = _error(call)
            assert isinstance(err, UnknownRequest)
            assert str(err) == str(never).replace("never-used", "r1")
        # Its own request of the same id is its own business.
        assert b.admit("r1", [7, 8, 9]).prefix_len == 0
        b.finish("r1")
        with pytest.raises(DuplicateRequest, match="'r1'"):  # A's own id, in A's words
            a.admit("r1", prompt)
        assert len(a.extend("r1", 2).slots) == 2  # A's request is untouched
        assert a.finish("r1").cached_tokens == 28
        again = a.admit("r2", prompt)
        assert again.prefix_len == 28  # A's cached pages, not B's tokens
        a.abort("r2")
    settled(coord)
    assert coord.stats()["running"] == 0


def test_int_and_str_ids_stay_apart_and_bad_ids_are_refused(coord, front) -> None:
    with NetworkClient(front.endpoint) as c:
        c.admit(5, [1, 2, 3])
        c.admit("5", [1, 2, 3])  # not the same request
        with pytest.raises(UnknownRequest, match=r"request 6\b"):
            c.extend(6, 1)
        with pytest.raises(api.BadRequest):
            c.admit(True, [1, 2, 3])
        c.abort(5)
        c.abort("5")
    settled(coord)


def test_a_session_brings_a_client_back_to_its_requests(coord, front) -> None:
    session = b"router-7" + os.urandom(16)
    with NetworkClient(front.endpoint, session=session) as c:
        c.admit("kept", [4, 5, 6, 7])
    with NetworkClient(front.endpoint) as other, pytest.raises(UnknownRequest):
        other.abort("kept")
    with NetworkClient(front.endpoint, session=session) as back:
        assert back.finish("kept").cached_tokens == 4
    for bad in (b"short", b"\x00" + os.urandom(16), "text" * 8):
        with pytest.raises(api.BadRequest, match="session"):
            NetworkClient(front.endpoint, session=bad)  # type: ignore[arg-type]


def test_network_stats_show_a_client_its_own_figures_only(coord, front) -> None:
    with NetworkClient(front.endpoint) as a, NetworkClient(front.endpoint) as b:
        a.admit("x", list(range(100, 140)))
        a.finish("x")
        before = b.stats()
        a.admit("y", list(range(100, 140)))  # A traffic: a hit of 36 (the last page is computed)
        a.abort("y")
        after = b.stats()
        assert after == before  # nothing of A's traffic shows to B
        assert after["scope"] == "client" and after["queries"] == 0
        for key in ("free", "evictable", "held", "query_tokens_total", "running", "digest"):
            assert key not in after
        mine = a.stats()
        assert (mine["queries"], mine["query_tokens"], mine["hit_tokens"]) == (2, 80, 36)
        assert mine["tp"] == 2 and mine["capacity"] == coord.stats()["capacity"]


def test_tenants_salts_are_bound_to_their_token(coord) -> None:
    cfg = FrontendConfig(endpoint="tcp://127.0.0.1:*", tenants={"a": TOKEN_A, "b": TOKEN_B})
    front = serve_network(coord, cfg)
    prompt = list(range(200, 240))
    try:
        with (
            NetworkClient(front.endpoint, token=TOKEN_A) as a,
            NetworkClient(front.endpoint, token=TOKEN_B) as b,
        ):
            a.admit("p", prompt, cache_salt="secret")
            a.finish("p")
            # B guessed A's salt: its KV is still apart from A's.
            assert b.admit("q", prompt, cache_salt="secret").prefix_len == 0
            b.finish("q")
            with NetworkClient(front.endpoint, token=TOKEN_A) as a2:  # A again, another connection
                assert a2.admit("p2", prompt, cache_salt="secret").prefix_len == 36
                a2.abort("p2")
            # No salt: the shared namespace, as without tenants.
            a.admit("d", prompt)
            a.finish("d")
            assert b.admit("e", prompt).prefix_len == 36
            b.abort("e")
        with NetworkClient(front.endpoint) as anon, pytest.raises(api.Unauthenticated):
            anon.admit("z", prompt)
    finally:
        front.close()
        coord.reset()
    for bad, why in (
        ({"a": "short"}, "at least 16"),
        ({"": TOKEN_A}, "name"),
        ({"a": TOKEN_A, "b": TOKEN_A}, "another's"),
        ([("a", TOKEN_A)], "dict"),
    ):
        with pytest.raises(FrontendConfigError, match=why):
            FrontendConfig(tenants=bad)  # type: ignore[arg-type]
    with pytest.raises(FrontendConfigError, match="another's"):
        FrontendConfig(token=TOKEN_A, tenants={"a": TOKEN_A})
    # Tenants guard a network address as a token does.
    FrontendConfig(endpoint="tcp://0.0.0.0:5999", tenants={"a": TOKEN_A})


def test_a_timed_out_call_is_not_applied_twice(coord, front) -> None:
    """The frontend's thread waits on the coordinator's lock (held here), so the client's
    extend gets no reply in time: its outcome is unknown, not retryable. Once the lock
    goes, the extend applies; ``resend`` gets its reply without applying it again."""
    with NetworkClient(front.endpoint, timeout_s=0.3) as c:
        c.admit("r", list(range(1, 10)))
        resent: list[list[api.Reply]] = []
        with coord.lock:
            with pytest.raises(api.OutcomeUnknown) as got:
                c.extend("r", 1)
            assert not got.value.retryable
            c.timeout_s = 10.0
            # Sent again while the first is still waiting (the client used by one thread
            # at a time: this one waits below): one is applied, both answered.
            waiter = threading.Thread(target=lambda: resent.append(c.resend(got.value)))
            waiter.start()
            waiter.join(0.3)  # the resend is out; its reply cannot come while the lock is held
            assert waiter.is_alive()
        waiter.join(10.0)
        (first,) = resent[0]
        (second,) = c.resend(got.value)  # the earlier send's reply, the same again
        (third,) = c.resend(got.value)
        assert isinstance(first, api.SlotsReply) and first == second == third
        assert len(c.extend("r", 1).slots) == 1
        settled(coord)
        known_as = scoped_id(owner_of("", c.session), "r")
        assert coord.mirror.request_row(known_as).num_tokens == 9 + 1 + 1  # each extend once
        assert front.resent == 3
        c.abort("r")
        with pytest.raises(api.BadRequest, match="resend takes"):
            c.resend(TimeoutError("not ours"))  # type: ignore[arg-type]


def test_a_request_refused_whole_is_a_typed_error_in_a_batch(coord) -> None:
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*", token=TOKEN_A))
    try:
        with NetworkClient(front.endpoint, token="wrong" * 4) as c:
            with c.batch() as b:
                x = b.admit("x", [1, 2, 3])
                y = b.extend("x", 1)
            for p in (x, y):
                with pytest.raises(api.Unauthenticated):
                    p.result()
    finally:
        front.close()
    assert coord.stats()["running"] == 0


_FLOOD = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 2000)
s.connect(sys.argv[1])
size = int(sys.argv[2]) << 20
for _ in range(int(sys.argv[3])):
    s.send_multipart([b"\\0" * 8, b"wrong-token-wrong", b"\\x91" + b"\\x00" * size])
s.close()
ctx.term()
"""


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_message_is_never_held(coord) -> None:
    """Four messages of 128 MB from a client with a wrong token (another process): ZMQ
    drops the connection at the frame's header, so this process (the server) does not
    grow by them, and a legitimate client is served at once after."""
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*", token=TOKEN_A))
    try:
        before = _rss_mb()
        peak = [before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mb())
                time.sleep(0.02)

        t = threading.Thread(target=watch)
        t.start()
        subprocess.run(
            [sys.executable, "-c", _FLOOD, front.endpoint, "128", "4"], check=True, timeout=120
        )
        time.sleep(0.5)
        stop.set()
        t.join()
        print(f"server RSS {before:.0f} MB before, peak {peak[0]:.0f} MB during the flood")
        assert peak[0] - before < 64
        with NetworkClient(front.endpoint, token=TOKEN_A, timeout_s=5.0) as ok:
            started = time.perf_counter()
            ok.admit("after", [1, 2, 3])
            assert time.perf_counter() - started < 2.0
            ok.abort("after")
    finally:
        front.close()


def _error(call) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("no error")


def test_many_frames_in_one_message_are_not_held(coord) -> None:
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"))
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(front.endpoint)
        s.send_multipart([b"\0" * 8, b"", *[b"x" * 1024] * 20_000])  # 20 MB in 20k frames
        assert not s.poll(500)  # not the protocol: dropped, no reply
        with NetworkClient(front.endpoint) as ok:
            assert ok.admit("fine", [1, 2]).prefix_len == 0
            ok.abort("fine")
    finally:
        ctx.destroy(linger=0)
        front.close()
