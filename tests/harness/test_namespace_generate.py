"""``tpcache generate`` with a cache namespace: the engine admits its prefills in the
namespace it is given, and a salted run's hits equal a salted replay's on the same slice.
Thread ranks over a real gloo group, a tiny reference model."""

from __future__ import annotations

import pytest
from test_generate import TINY

from tpcache.cache.namespace import CacheNamespace
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.forward import ModelEngine, Prefill
from tpcache.harness.gen_wire import GenerateError
from tpcache.harness.generate import GenerateOptions, group_config, run_generate, scaled_requests
from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE, load_trace


def test_the_engine_prefills_in_its_requests_namespace() -> None:
    trace = load_trace(DEFAULT_TRACE, 2)
    opts = GenerateOptions(scale=32, model=TINY, salt="t")
    coord = start_local_group(group_config(opts, scaled_requests(trace, 32)))
    try:
        engine = ModelEngine(coord)
        prompt = list(range(1, 40))
        space = CacheNamespace(salt="t")
        hits = []
        for rid, ns in (("a", space), ("b", None), ("c", space)):
            (out,) = engine.step([Prefill(rid, prompt, namespace=ns)])
            hits.append(out.prefix_len)
            engine.finish(rid)
        assert hits == [0, 0, 32]  # page 16: "c" hits what "a" cached, "b" nothing
        coord.sync()
        assert list(s[0] for s in coord.mirror.tree.spaces.values()) == [space]
        assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2
    finally:
        coord.close()


def test_a_salted_run_hits_as_a_salted_replay() -> None:
    trace = load_trace(DEFAULT_TRACE, 12)
    out = run_generate(trace, GenerateOptions(scale=32, clients=3, model=TINY, salt="t", lora_id=2))
    rp = replay(trace, ReplayOptions(None, 16, scale=32, salts=("t",), lora_id=2))
    assert out["cache"]["matched_tokens"] == rp["matched_tokens"] > 0
    with pytest.raises(GenerateError, match="salt must have 1 to 256 characters"):
        GenerateOptions(model=TINY, salt="")
