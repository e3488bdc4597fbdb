"""The serving engine over real checkpoints, checked against transformers (code tpcache
did not write): requests that share a prefix (cache hits), prefill cut into chunks, and
a KV pool too small for all of them at once (preemption and resume) still generate
exactly transformers' greedy tokens, at TP=2 on thread ranks over gloo."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from conftest import Collector, nothing_held
from hf_checkpoints import hf_greedy, hf_model, write_checkpoint

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.engine.requests import Finished, GenerateRequest, SamplingParams
from tpcache.workers.spec import CacheSpec

PAGE = 4
NEW = 12


def served(model_dir, capacity: int) -> tuple:
    args = {"model": str(model_dir)}
    config = GroupConfig(
        tp=2,
        capacity_tokens=capacity,
        cache=CacheSpec(page_size=PAGE, max_request_tokens=128),
        dtype="float32",
        cpu_budget_bytes=1 << 24,
        timeout_s=30.0,
        runner="tpcache.model.llama:LlamaRunner",
        runner_args=args,
        coordinator=CoordinatorConfig(auto_recover=False),
    )
    coord = start_local_group(config)
    engine = Engine(coord, EngineConfig(step_tokens=10, max_batch=4), vocab=256)
    engine.start()
    return coord, engine


@pytest.mark.parametrize("family", ["llama31", "qwen2", "qwen3"])
def test_hits_chunks_and_preemption_give_transformers_tokens(tmp_path, family):
    seed = 7
    print(f"seed {seed}")
    model = hf_model(family, seed)
    ckpt = write_checkpoint(model, tmp_path / family)
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, 256, 12).tolist()
    prompts = [stem + rng.integers(0, 256, 9).tolist() for _ in range(4)]
    want = [hf_greedy(model, p, NEW) for p in prompts]
    for capacity, pressed in ((1024, False), (72, True)):
        coord, engine = served(ckpt, capacity)
        try:
            sink = Collector()
            for i, p in enumerate(prompts):
                engine.submit(GenerateRequest(i, p, SamplingParams(NEW, ignore_eos=True)), sink)
            ends = sink.wait(range(4), timeout=120)
            assert all(isinstance(e, Finished) for e in ends.values()), ends
            assert [sink.tokens(i) for i in range(4)] == want
            stats = engine.stats()
            assert stats["cached_tokens"] >= 12  # the shared stem, at least once
            assert (stats["preemptions"] > 0) == pressed, stats
            # Each request's own count of prefill computed adds up to the engine's; a
            # preempted one computes more than its prompt minus its cached prefix.
            assert sum(e.computed_tokens for e in ends.values()) == stats["prefill_tokens"]
            over = [e.computed_tokens > e.prompt_tokens - e.cached_tokens for e in ends.values()]
            assert any(over) == pressed
            engine.close()
            nothing_held(coord)
        finally:
            engine.close()
            coord.close()
