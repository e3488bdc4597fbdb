"""Sampling: greedy is the argmax with ties to the lowest id; a seeded request gives the
same tokens on every run; top-k 1 is greedy; top-p keeps the smallest likely set."""

from __future__ import annotations

import numpy as np
from conftest import Collector, greedy_reference, prompts

from tpcache.engine.loop import Engine
from tpcache.engine.requests import GenerateRequest, SamplingParams
from tpcache.engine.sampling import sample


def test_sample_rules():
    rng = np.random.default_rng(0)
    tie = np.array([0.0, 3.0, 3.0, 1.0], np.float32)
    assert sample(tie, SamplingParams(), rng) == 1
    assert sample(tie, SamplingParams(temperature=1.0, top_k=1), rng) == 1
    # top_p: 0.5 of the mass is token 2's alone
    p = np.log(np.array([0.1, 0.15, 0.5, 0.25]))
    assert {sample(p, SamplingParams(temperature=1.0, top_p=0.5), rng) for _ in range(50)} == {2}
    assert {sample(p, SamplingParams(temperature=1.0, top_p=0.7), rng) for _ in range(100)} == {
        2,
        3,
    }
    draws = [sample(p, SamplingParams(temperature=1.0), rng) for _ in range(4000)]
    freq = np.bincount(draws, minlength=4) / 4000
    assert np.abs(freq - np.array([0.1, 0.15, 0.5, 0.25])).max() < 0.03, freq
    a = [sample(p, SamplingParams(temperature=2.0), np.random.default_rng(9)) for _ in range(5)]
    b = [sample(p, SamplingParams(temperature=2.0), np.random.default_rng(9)) for _ in range(5)]
    assert a == b


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(make_group):
    (p,) = prompts(31, 1, 10)
    engine = Engine(make_group())
    engine.start()
    sink = Collector()
    hot = dict(max_new_tokens=16, temperature=1.5)
    try:
        engine.submit(GenerateRequest("a", p, SamplingParams(seed=7, **hot)), sink)
        engine.submit(GenerateRequest("b", p, SamplingParams(seed=7, **hot)), sink)
        engine.submit(GenerateRequest("c", p, SamplingParams(seed=8, **hot)), sink)
        engine.submit(GenerateRequest("k1", p, SamplingParams(top_k=1, seed=1, **hot)), sink)
        engine.submit(GenerateRequest("free", p, SamplingParams(**hot)), sink)  # a drawn seed
        ends = sink.wait(["a", "b", "c", "k1", "free"])
    finally:
        engine.close()
    assert ends["a"].tokens == ends["b"].tokens != ends["c"].tokens
    assert list(ends["k1"].tokens) == greedy_reference(p, 16)
    assert len(ends["free"].tokens) == 16
