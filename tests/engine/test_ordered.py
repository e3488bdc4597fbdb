"""Ordered admission: a request that shares whole pages with a prompt still in prefill
waits for it, so prefill computed is prompt - matched as if the requests came one by
one (``tpcache replay``'s figure), and nothing is preempted."""

from __future__ import annotations

from conftest import PAGE, Collector, prompts

from tpcache.cache.radix import RadixCache
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import GenerateRequest, SamplingParams


def test_ordered_admission_computes_prompt_minus_matched(make_group):
    ps = prompts(41, 3, 40, shared=22) + prompts(42, 3, 30, shared=13)
    coord = make_group(capacity=1024)
    engine = Engine(coord, EngineConfig(step_tokens=64, ordered_admission=True))
    sink = Collector()
    for i, p in enumerate(ps):
        engine.submit(GenerateRequest(i, p, SamplingParams(max_new_tokens=3)), sink)
    engine.start()
    try:
        ends = sink.wait(range(len(ps)))
    finally:
        engine.close()
    # one by one on a plain cache: each prompt matched against the ones before
    local = RadixCache(coord.mirror.config)
    matched = []
    for i, p in enumerate(ps):
        matched.append(local.admit(i, p).prefix_len)
        local.finish(i, ends[i].tokens)
    assert [ends[i].cached_tokens for i in range(len(ps))] == matched
    assert matched == [0, 20, 20, 0, 12, 12]  # whole pages of PAGE = 4
    st = engine.stats()
    assert st["prefill_tokens"] == sum(len(p) for p in ps) - sum(matched)
    assert st["waits"] > 0 and st["preemptions"] == 0
    assert PAGE == 4
