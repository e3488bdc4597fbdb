"""The serving engine on thread ranks: greedy output equals the model's own continuation
and a plain step-by-step ``ModelEngine`` loop; cached prefixes are not computed again;
chunked prefill changes nothing; stop tokens and end-of-sequence ids stop it."""

from __future__ import annotations

import numpy as np
from conftest import PAGE, Collector, greedy_reference, nothing_held, prompts

from tpcache.engine.forward import ModelEngine
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import Finished, GenerateRequest, SamplingParams


def run_all(engine: Engine, reqs: list[GenerateRequest]) -> tuple[Collector, dict]:
    sink = Collector()
    for r in reqs:
        engine.submit(r, sink)
    return sink, sink.wait([r.rid for r in reqs])


def plain_loop(eng: ModelEngine, rid: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """Prefill, then one decode per token: one request at a time, no engine."""
    _, logits = eng.prefill(rid, prompt)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        out.append(int(np.argmax(eng.decode(rid, out[-1]).logits[-1])))
    eng.coord.abort(rid)
    return out


def test_greedy_equals_a_plain_loop_and_the_model(make_group):
    ps = prompts(11, 5, 21, shared=9)
    engine = Engine(make_group(), EngineConfig(step_tokens=64))
    engine.start()
    try:
        reqs = [GenerateRequest(i, p, SamplingParams(max_new_tokens=12)) for i, p in enumerate(ps)]
        sink, ends = run_all(engine, reqs)
    finally:
        engine.close()
    plain = ModelEngine(make_group())
    for i, p in enumerate(ps):
        want = plain_loop(plain, f"plain{i}", p, 12)
        assert sink.tokens(i) == want == list(ends[i].tokens)
        assert ends[i].reason == "length" and ends[i].prompt_tokens == 21
    assert want == greedy_reference(ps[-1], 12)
    st = engine.stats()
    assert st["finished"] == 5 and st["generated"] == 60 and st["max_batch"] > 1
    nothing_held(engine.coord)


def test_a_cached_prefix_is_not_computed_again(make_group):
    a, b = prompts(12, 2, 30, shared=26)
    engine = Engine(make_group(), vocab=64)
    engine.start()
    try:
        _, first = run_all(engine, [GenerateRequest("a", a, SamplingParams(max_new_tokens=4))])
        before = engine.stats()["prefill_tokens"]
        _, second = run_all(engine, [GenerateRequest("b", b, SamplingParams(max_new_tokens=4))])
        computed = engine.stats()["prefill_tokens"] - before
    finally:
        engine.close()
    assert first["a"].cached_tokens == 0
    assert second["b"].cached_tokens == 24  # the whole pages a shares with b
    assert computed == 30 - 24
    assert (first["a"].computed_tokens, second["b"].computed_tokens) == (30, 6)
    assert list(second["b"].tokens) == greedy_reference(b, 4)
    nothing_held(engine.coord)


def test_a_chunked_prompt_that_ends_at_its_first_token_is_cached_by_its_own_tokens(make_group):
    """The last prefill chunk gives slots, not tokens: the cache must learn the rest of
    the prompt before the request finishes, or its KV is keyed by what it was not
    computed for (and the next request sharing the prompt matches only the first chunk)."""
    (a,) = prompts(21, 1, 30)
    b = (*a, 7, 7, 7)
    engine = Engine(make_group(), EngineConfig(step_tokens=8), vocab=64)
    engine.start()
    try:
        _, first = run_all(engine, [GenerateRequest("a", a, SamplingParams(max_new_tokens=1))])
        _, second = run_all(engine, [GenerateRequest("b", b, SamplingParams(max_new_tokens=4))])
    finally:
        engine.close()
    assert first["a"].reason == "length" and first["a"].computed_tokens == 30
    assert second["b"].cached_tokens == 28  # every whole page of a's prompt (page 4)
    assert list(second["b"].tokens) == greedy_reference(b, 4)
    nothing_held(engine.coord)


def test_chunked_prefill_equals_unchunked(make_group):
    ps = prompts(13, 3, 37)
    got = {}
    for step in (2048, 5):
        engine = Engine(make_group(), EngineConfig(step_tokens=step))
        engine.start()
        try:
            reqs = [
                GenerateRequest(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(ps)
            ]
            _, ends = run_all(engine, reqs)
        finally:
            engine.close()
        got[step] = [ends[i].tokens for i in range(3)]
        st = engine.stats()
        assert st["prefill_tokens"] == 3 * 37
        if step == 5:
            assert st["forwards"] >= 3 * 37 // 5
    assert got[5] == got[2048]
    assert list(got[5][0]) == greedy_reference(ps[0], 6)


def test_stop_tokens_and_eos(make_group):
    (p,) = prompts(14, 1, 16)
    free = greedy_reference(p, 12)
    stop = free[4]
    cut = free[: free.index(stop) + 1]
    coord = make_group()
    engine = Engine(coord, EngineConfig(eos_token_ids=(stop,)))
    engine.start()
    try:
        sp = SamplingParams(max_new_tokens=12)
        ends = run_all(
            engine,
            [
                GenerateRequest("eos", p, sp),
                GenerateRequest("ignore", p, SamplingParams(max_new_tokens=12, ignore_eos=True)),
                GenerateRequest(
                    "stop",
                    p,
                    SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(free[2],)),
                ),
            ],
        )[1]
    finally:
        engine.close()
    assert (ends["eos"].reason, list(ends["eos"].tokens)) == ("stop", cut)
    assert (ends["ignore"].reason, list(ends["ignore"].tokens)) == ("length", free)
    assert (ends["stop"].reason, list(ends["stop"].tokens)) == (
        "stop",
        free[: free.index(free[2]) + 1],
    )
    nothing_held(coord)


def test_finished_requests_are_cached_for_later_ones(make_group):
    """A request that continues another's prompt + output hits all of it."""
    (p,) = prompts(15, 1, 14)
    engine = Engine(make_group())
    engine.start()
    try:
        _, e1 = run_all(engine, [GenerateRequest("one", p, SamplingParams(max_new_tokens=9))])
        follow = (*p, *e1["one"].tokens, 3, 4)
        _, e2 = run_all(engine, [GenerateRequest("two", follow, SamplingParams(max_new_tokens=2))])
    finally:
        engine.close()
    kv = 14 + 9 - 1  # the last output token never got KV
    assert e2["two"].cached_tokens == kv // PAGE * PAGE
    assert isinstance(e2["two"], Finished)


def test_without_the_prefix_cache_nothing_is_cached(make_group):
    (p,) = prompts(16, 1, 20)
    coord = make_group()
    engine = Engine(coord, EngineConfig(prefix_cache=False))
    engine.start()
    try:
        _, e1 = run_all(engine, [GenerateRequest("a", p, SamplingParams(max_new_tokens=5))])
        _, e2 = run_all(engine, [GenerateRequest("b", p, SamplingParams(max_new_tokens=5))])
    finally:
        engine.close()
    assert e1["a"].tokens == e2["b"].tokens
    assert e2["b"].cached_tokens == 0 and engine.stats()["prefill_tokens"] == 40
    assert coord.mirror.sizes().evictable == 0
    nothing_held(coord)


def test_a_namespace_keeps_its_cache_apart(make_group):
    from tpcache.cache.namespace import CacheNamespace

    (p,) = prompts(17, 1, 20)
    coord = make_group()
    got = {}
    for name, space in (
        ("salted", CacheNamespace(salt="t1")),
        ("plain", None),
        ("again", CacheNamespace(salt="t1")),
    ):
        engine = Engine(coord, EngineConfig(namespace=space))
        engine.start()
        try:
            got[name] = run_all(
                engine, [GenerateRequest(name, p, SamplingParams(max_new_tokens=3))]
            )[1][name]
        finally:
            engine.close()
    assert (
        got["salted"].cached_tokens,
        got["plain"].cached_tokens,
        got["again"].cached_tokens,
    ) == (0, 0, 16)  # an admit matches at most len - 1 tokens, in whole pages
    assert got["salted"].tokens == got["plain"].tokens == got["again"].tokens
