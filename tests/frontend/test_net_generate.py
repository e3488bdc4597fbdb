"""Generate over the network frontend (a TP=2 group of gloo rank threads running the
reference model, the serving engine, real ZMQ on loopback, the torch-free client):
streamed and whole answers, concurrent clients, a client that goes away mid-stream,
requests that can never fit, bad sampling, and a server that serves no model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from gen_net_helpers import served_model, undisturbed

from tpcache.client import NetworkClient
from tpcache.engine.errors import RequestTooLarge
from tpcache.engine.requests import BadSampling
from tpcache.frontend import api


def _idle(s, timeout: float = 20.0) -> dict:
    """The coordinator's stats once no request runs there or on the frontend, checked:
    every slot is free or evictable again (none held)."""
    deadline = time.monotonic() + timeout
    while True:
        st = s.coord.stats()
        if (st["running"] == 0 and s.front.generate.running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (st["running"], st["held"], s.front.generate.running) == (0, 0, 0)
    assert st["free"] + st["evictable"] == st["capacity"]
    return st


def test_streamed_and_whole_answers_agree_with_the_engine() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with served_model() as s:
        with NetworkClient(s.front.endpoint) as c:
            whole = c.generate(prompt, 12, ignore_eos=True)
            assert isinstance(whole, api.GeneratedReply)
            assert (whole.finish_reason, whole.prompt_tokens, len(whole.tokens)) == (
                "length",
                8,
                12,
            )
            stream = c.generate(prompt, 12, ignore_eos=True, stream=True)
            assert list(stream) == whole.tokens and stream.result is not None
            assert (stream.result.tokens, stream.result.finish_reason) == (whole.tokens, "length")
            stream.close()  # after the end: nothing to cancel
            # The wire's whole form (the client streams even a whole answer): one reply.
            (raw,) = c.send([api.GenerateCall("raw", prompt, 12, ignore_eos=True)])
            assert isinstance(raw, api.GeneratedReply) and raw.tokens == whole.tokens
            # The second run found the first's prompt in the cache.
            again = c.generate(prompt, 12, ignore_eos=True)
            assert again.tokens == whole.tokens and again.cached_tokens >= 4
            # What each computed: the whole prompt first, then only what was not cached.
            assert whole.computed_tokens == len(prompt)
            assert again.computed_tokens == len(prompt) - again.cached_tokens
        _idle(s)
        assert whole.tokens == undisturbed(s.coord, prompt, 12)


def test_stop_tokens_and_a_seeded_sample_repeat() -> None:
    with served_model() as s, NetworkClient(s.front.endpoint) as c:
        greedy = c.generate([7, 8, 9], 10, ignore_eos=True).tokens
        stop = c.generate([7, 8, 9], 10, stop_token_ids=[greedy[2]])
        cut = greedy.index(greedy[2]) + 1
        assert (stop.tokens, stop.finish_reason) == (greedy[:cut], "stop")
        a = c.generate([7, 8, 9], 10, temperature=1.0, top_k=8, seed=5, ignore_eos=True)
        b = c.generate([7, 8, 9], 10, temperature=1.0, top_k=8, seed=5, ignore_eos=True)
        assert a.tokens == b.tokens and len(a.tokens) == 10


def test_concurrent_clients_and_streams() -> None:
    prompts = [[i + 1, (i * 7) % 60 + 1, 5, i % 3 + 2] for i in range(6)]
    with served_model() as s:
        want = {}
        with NetworkClient(s.front.endpoint) as c:
            for i, p in enumerate(prompts):
                want[i] = c.generate(p, 8, ignore_eos=True).tokens
        got: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                with NetworkClient(s.front.endpoint) as c:
                    got[i] = list(c.generate(prompts[i], 8, ignore_eos=True, stream=True))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and got == want
        # One client, three streams open at once, read in turns.
        with NetworkClient(s.front.endpoint) as c:
            streams = [c.generate(prompts[i], 8, ignore_eos=True, stream=True) for i in range(3)]
            out: list[list[int]] = [[], [], []]
            for _ in range(8):
                for i, st in enumerate(streams):
                    out[i].append(next(st))
            assert out == [want[0], want[1], want[2]]
            for st in streams:
                assert list(st) == []
        _idle(s)


def test_a_client_that_goes_away_mid_stream_is_cancelled() -> None:
    with served_model() as s:
        c = NetworkClient(s.front.endpoint)
        it = c.generate([1, 2, 3, 4], 100, ignore_eos=True, stream=True)
        assert len([next(it) for _ in range(3)]) == 3
        c.close()  # no cancel sent: the socket is gone
        _idle(s)
        assert s.front.generate.dropped == 1
        assert s.engine.stats()["live"] == 0
        # A process waiting for a whole answer, killed: found as its tokens are sent.
        code = (
            "import sys; from tpcache.client import NetworkClient\n"
            "NetworkClient(sys.argv[1]).generate([4, 3, 2, 1], 120, ignore_eos=True)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code, s.front.endpoint])
        deadline = time.monotonic() + 60
        while s.front.generate.running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        _idle(s)
        assert s.front.generate.dropped == 2
        # Closing the iterator (or leaving its block) cancels explicitly.
        with NetworkClient(s.front.endpoint) as c2:
            it = c2.generate([1, 2, 3, 4], 100, ignore_eos=True, stream=True, request_id=7)
            next(it)
            it.close()
            _idle(s)
            with c2.generate([1, 2, 3, 4], 100, ignore_eos=True, stream=True) as it:
                next(it)
            _idle(s)
            assert it.result is None and list(it) == []
            assert s.front.generate.dropped == 2  # cancelled by the client, not dropped
            assert c2.cancel("nothing-running") is False


def test_refusals_are_typed_and_hold_nothing() -> None:
    with served_model(capacity=256, max_request=64) as s, NetworkClient(s.front.endpoint) as c:
        with pytest.raises(RequestTooLarge, match="64"):
            c.generate(list(range(1, 60)), 20)
        with pytest.raises(BadSampling, match="top_p"):
            c.generate([1, 2], 4, top_p=1.5)
        with pytest.raises(BadSampling, match="max_new_tokens"):
            c.generate([1, 2], 0)
        with pytest.raises(BadSampling, match="vocabulary"):
            c.generate([1, 2, 999], 4)
        # Past the client's own checks: a raw call with a bad field, refused by name.
        (reply,) = c.send([api.GenerateCall("raw", [1, 2], top_k=-1)])
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadSampling"
        assert "top_k" in reply.message
        (reply,) = c.send([api.GenerateCall("raw", [1, 2]), api.StatsCall()])[:1]
        assert reply.error == "BadRequest"
        st = s.coord.stats()
        assert st["running"] == 0 and s.front.generate.running == 0


def test_generate_on_a_server_without_a_model() -> None:
    import threading as th

    from net_helpers import group

    from tpcache.frontend.frontend import serve_network
    from tpcache.frontend.netfront import FrontendConfig

    coord = group()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), th.Lock())
    try:
        with NetworkClient(front.endpoint) as c:
            with pytest.raises(api.NoModel, match="serves no model"):
                c.generate([1, 2, 3], 4)
            with pytest.raises(api.NoModel):
                list(c.generate([1, 2, 3], 4, stream=True))
            assert c.admit("a", [1, 2, 3]).prefix_len == 0  # cache calls still served
    finally:
        front.close()
        coord.close()


def test_generate_calls_beyond_the_limit_are_busy() -> None:
    from tpcache.frontend.frontend import handle

    with served_model(max_queue=2) as s, NetworkClient(s.front.endpoint) as c:
        open_ = [c.generate([1, 2, 3], 100, ignore_eos=True, stream=True) for _ in range(2)]
        with pytest.raises(api.Busy, match="2 generate calls are running") as got:
            c.generate([4, 5, 6], 4)
        assert got.value.retryable
        for it in open_:
            it.close()
        _idle(s)
        assert len(c.generate([4, 5, 6], 4).tokens) == 4  # (the model has no eos ids)
        # In-process and Ray cache calls do not take generate calls.
        reply = api.decode_reply(handle(s.coord, api.encode(api.GenerateCall("x", [1]))))
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest"


def test_ray_generate_cancels_a_request_no_one_polls() -> None:
    """``RayGenerate`` (the Ray service's generate, here over thread ranks): a request
    whose client stops polling is cancelled after ``abandon_s`` and forgotten."""
    from tpcache.frontend.owners import Owner
    from tpcache.frontend.ray_gen import RayGenerate

    with served_model() as s:
        gen = RayGenerate(s.engine, abandon_s=0.3)
        who = Owner(b"ray:test-session")
        call = api.GenerateCall("r1", [1, 2, 3], 100, ignore_eos=True, stream=True)
        assert isinstance(api.decode_reply(gen.start(api.encode(call), who)), api.OkReply)
        first = [api.decode_reply(b) for b in gen.poll(who, "r1", 5.0)]
        assert isinstance(first[0], api.TokensReply) and first[0].start == 0
        again = api.decode_reply(gen.start(api.encode(call), who))
        assert isinstance(again, api.ErrorReply) and "'r1'" in again.message
        time.sleep(0.5)
        gen.sweep()
        assert (gen.abandoned, gen.running) == (1, 0)
        (gone,) = [api.decode_reply(b) for b in gen.poll(who, "r1", 0.0)]
        assert isinstance(gone, api.ErrorReply) and gone.error == "UnknownRequest"
        _idle(s)


def test_request_ids_are_each_clients_own() -> None:
    with (
        served_model() as s,
        NetworkClient(s.front.endpoint) as a,
        NetworkClient(s.front.endpoint) as b,
    ):
        mine = a.generate([1, 2, 3], 30, ignore_eos=True, stream=True, request_id="same")
        first = next(mine)
        assert b.cancel("same") is False  # another client's id: unknown to it
        theirs = b.generate([1, 2, 3], 30, ignore_eos=True, request_id="same")
        rest = list(mine)
        assert [first, *rest] == theirs.tokens and mine.result.finish_reason == "length"
        _idle(s)


def test_no_token_in_time_is_a_timeout_and_cancels() -> None:
    with served_model() as s, NetworkClient(s.front.endpoint, timeout_s=0.001) as c:
        with pytest.raises(api.GenerateTimeout, match="cancelled") as got:
            c.generate([1, 2, 3], 100, ignore_eos=True)
        assert got.value.retryable
        it = c.generate([1, 2, 3], 100, ignore_eos=True, stream=True)
        with pytest.raises(api.GenerateTimeout):
            list(it)
        assert it.result is None and list(it) == []
        c.timeout_s = 30.0
        _idle(s)  # both cancelled, their slots back
        assert s.engine.stats()["live"] == 0
