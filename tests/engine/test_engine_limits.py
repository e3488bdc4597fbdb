"""The engine under pressure and misuse: preemption when the KV pool runs out gives the
same tokens as a run with room; typed errors before anything is held; cancel and close
give every slot back; a sink that raises cancels its request; submits from many threads."""

from __future__ import annotations

import threading

import pytest
from conftest import Collector, greedy_reference, nothing_held, prompts

from tpcache.cache.errors import CacheError
from tpcache.cache.errors import DuplicateRequest as CacheDuplicate
from tpcache.engine.errors import (
    DuplicateRequest,
    EngineClosed,
    EngineConfigError,
    RequestTooLarge,
)
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import (
    BadSampling,
    Failed,
    Finished,
    GenerateRequest,
    SamplingParams,
    TokenOut,
)


def test_preemption_under_kv_pressure_keeps_the_tokens(make_group):
    """Four requests that each end at 41 tokens of KV in a pool of 96: they cannot all
    run to the end at once, so the newest are preempted and resumed."""
    ps = prompts(21, 4, 14, shared=4)
    got = {}
    for capacity in (1024, 96):
        coord = make_group(capacity=capacity, limit=64)
        engine = Engine(coord, EngineConfig(step_tokens=32))
        engine.start()
        sink = Collector()
        try:
            for i, p in enumerate(ps):
                engine.submit(GenerateRequest(i, p, SamplingParams(max_new_tokens=28)), sink)
            ends = sink.wait(range(4))
        finally:
            engine.close()
        got[capacity] = [sink.tokens(i) for i in range(4)]
        assert all(list(ends[i].tokens) == got[capacity][i] for i in range(4))
        st = engine.stats()
        print(capacity, st)
        if capacity == 96:
            assert st["preemptions"] > 0
            assert sum(ends[i].preemptions for i in range(4)) == st["preemptions"]
        else:
            assert st["preemptions"] == 0
        nothing_held(coord)
    assert got[96] == got[1024]
    assert got[96][3] == greedy_reference(ps[3], 28)


def test_bad_requests_are_refused_before_anything_is_held(make_group):
    coord = make_group(capacity=256, limit=64)
    engine = Engine(coord, vocab=64)
    engine.start()
    sink = Collector()
    try:
        with pytest.raises(BadSampling, match="token id 64 is outside"):
            engine.submit(GenerateRequest("v", (1, 64)), sink)
        with pytest.raises(RequestTooLarge, match=r"needs KV for 65 tokens .* may hold 64"):
            engine.submit(GenerateRequest("big", (1,) * 60, SamplingParams(max_new_tokens=6)), sink)
        engine.submit(GenerateRequest("fits", (1,) * 60, SamplingParams(max_new_tokens=5)), sink)
        with pytest.raises(DuplicateRequest, match="'fits' is live"):
            engine.submit(GenerateRequest("fits", (2,)), sink)
        with pytest.raises(CacheError):
            engine.submit(GenerateRequest("x" * 300, (2,)), sink)
        with pytest.raises(BadSampling):
            engine.submit("not a request", sink)  # type: ignore[arg-type]
        assert sink.wait(["fits"])["fits"].reason == "length"
        assert set(sink.events) == {"fits"}
        assert issubclass(DuplicateRequest, CacheDuplicate)
    finally:
        engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(GenerateRequest("late", (1,)), sink)
    nothing_held(coord)
    for bad in (
        dict(step_tokens=0),
        dict(max_batch=True),
        dict(eos_token_ids=(-1,)),
        dict(timeout_s=float("nan")),
    ):
        with pytest.raises(EngineConfigError):
            EngineConfig(**bad)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Engine(coord, {"step_tokens": 8})  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError):
        Engine(coord, {"step_tokens": 8})  # type: ignore[arg-type]


def test_a_prompt_outside_a_vocabulary_learned_from_the_model_fails(make_group):
    """Without ``vocab=``, a one-token forward learns it before the first admission."""
    coord = make_group()
    engine = Engine(coord)
    sink = Collector()
    engine.submit(GenerateRequest("bad", (1, 99)), sink)
    engine.submit(GenerateRequest("good", (1, 9)), sink)
    engine.start()
    try:
        ends = sink.wait(["bad", "good"])
    finally:
        engine.close()
    assert isinstance(ends["bad"], Failed) and isinstance(ends["bad"].error, BadSampling)
    assert "99 is outside the model's vocabulary (ids 0..63)" in str(ends["bad"].error)
    assert isinstance(ends["good"], Finished) and engine.stats()["vocab"] == 64
    with pytest.raises(BadSampling):
        Engine(coord, vocab=0)
    nothing_held(coord)


def test_cancel_mid_generation_gives_the_slots_back(make_group):
    coord = make_group()
    engine = Engine(coord, EngineConfig(step_tokens=8))
    sink = Collector()
    three = threading.Event()

    def watch(ev):
        sink(ev)
        if isinstance(ev, TokenOut) and ev.index == 2:
            three.set()

    (p,) = prompts(22, 1, 20)
    engine.submit(GenerateRequest("c", p, SamplingParams(max_new_tokens=200)), watch)
    assert not engine.cancel("unknown")
    engine.start()
    try:
        assert three.wait(30)
        assert engine.cancel("c")
        end = sink.wait(["c"])["c"]
        assert not engine.cancel("c")  # ended
    finally:
        engine.close()
    assert end.reason == "cancelled" and 3 <= len(end.tokens) < 200
    assert list(end.tokens) == sink.tokens("c")
    assert engine.stats()["cancelled"] == 1
    nothing_held(coord)


def test_a_sink_that_raises_cancels_its_request(make_group):
    coord = make_group()
    engine = Engine(coord)
    got = []

    def bad(ev):
        got.append(ev)
        if isinstance(ev, TokenOut) and ev.index == 1:
            raise RuntimeError("client gone")

    engine.submit(GenerateRequest("r", (5, 6, 7), SamplingParams(max_new_tokens=100)), bad)
    engine.start()
    try:
        for _ in range(300):
            if got and isinstance(got[-1], Finished):
                break
            threading.Event().wait(0.1)
    finally:
        engine.close()
    assert isinstance(got[-1], Finished) and got[-1].reason == "cancelled"
    assert len(got[-1].tokens) < 100
    nothing_held(coord)


def test_close_fails_live_requests(make_group):
    coord = make_group()
    engine = Engine(coord, EngineConfig(step_tokens=4))
    sink = Collector()
    started = threading.Event()

    def watch(ev):
        sink(ev)
        started.set()

    engine.submit(GenerateRequest("run", (1, 2, 3), SamplingParams(max_new_tokens=200)), watch)
    engine.start()
    assert started.wait(30)
    engine.submit(GenerateRequest("queued", (1,) * 200, SamplingParams(max_new_tokens=50)), sink)
    engine.close()
    ends = sink.wait(["run", "queued"], timeout=5)
    for rid in ("run", "queued"):
        assert isinstance(ends[rid], Failed) and isinstance(ends[rid].error, EngineClosed)
        assert ends[rid].error.retryable
    assert not engine.cancel("run")
    nothing_held(coord)
    idle = Engine(coord)  # never started: close fails its requests itself
    idle.submit(GenerateRequest("q", (1,)), sink)
    idle.close()
    assert isinstance(sink.wait(["q"], timeout=1)["q"], Failed)


def test_submits_from_many_threads(make_group):
    coord = make_group(capacity=1024)
    engine = Engine(coord, EngineConfig(step_tokens=64, max_batch=6))
    engine.start()
    ps = prompts(23, 4, 12, shared=8)
    want = {i: greedy_reference(p, 6) for i, p in enumerate(ps)}
    sink = Collector()
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            for k in range(4):
                rid = f"t{t}-{k}"
                engine.submit(
                    GenerateRequest(rid, ps[(t + k) % 4], SamplingParams(max_new_tokens=6)), sink
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(6)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        ends = sink.wait([f"t{t}-{k}" for t in range(6) for k in range(4)])
    finally:
        engine.close()
    assert not errors
    for t in range(6):
        for k in range(4):
            assert list(ends[f"t{t}-{k}"].tokens) == want[(t + k) % 4]
    st = engine.stats()
    assert st["finished"] == 24 and st["max_batch"] <= 6 and st["cached_tokens"] > 0
    nothing_held(coord)
