"""Failed steps on thread ranks: a prompt the ranks refuse fails alone after
``max_recoveries`` re-admissions while the requests beside it finish with their own
tokens; a group that fails with recovery off fails its requests with a retryable error."""

from __future__ import annotations

import dataclasses
import threading

from conftest import Collector, greedy_reference, group_config, nothing_held, prompts
from drill_worker import DrillWorker
from poison_runner import POISON

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.errors import GenerationFailed
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import Failed, Finished, GenerateRequest, SamplingParams, TokenOut


def test_a_refused_prompt_fails_alone(make_group):
    cfg = dataclasses.replace(group_config(), runner="poison_runner:PoisonRunner")
    coord = start_local_group(cfg)
    try:
        engine = Engine(coord, EngineConfig(max_recoveries=3), vocab=64)
        ps = [tuple(min(t, POISON - 1) for t in p) for p in prompts(61, 3, 12)]
        bad = (*ps[0][:6], POISON, *ps[0][7:])
        sink = Collector()
        for i, p in enumerate(ps):
            engine.submit(GenerateRequest(i, p, SamplingParams(max_new_tokens=6)), sink)
        engine.submit(GenerateRequest("bad", bad, SamplingParams(max_new_tokens=6)), sink)
        engine.start()
        try:
            ends = sink.wait([0, 1, 2, "bad"])
        finally:
            engine.close()
        assert isinstance(ends["bad"], Failed) and isinstance(ends["bad"].error, GenerationFailed)
        assert ends["bad"].error.retryable and "re-admitted 3 times" in str(ends["bad"].error)
        for i, p in enumerate(ps):
            assert isinstance(ends[i], Finished) and ends[i].recoveries <= 3
            assert list(ends[i].tokens) == greedy_reference(p, 6)
        nothing_held(coord)
    finally:
        coord.close()


def test_a_group_that_stays_down_fails_its_requests():
    """Recovery off: a failed step leaves the group down, and the request fails with a
    retryable error, its tokens sent before kept."""
    coord = start_local_group(group_config(), worker_cls=DrillWorker)
    try:
        engine = Engine(coord, EngineConfig(recovery_wait_s=5.0), vocab=64)
        sink = Collector()
        two = threading.Event()

        def watch(ev):
            sink(ev)
            if isinstance(ev, TokenOut) and ev.index == 1:
                two.set()

        engine.submit(GenerateRequest("r", (1, 2, 3), SamplingParams(max_new_tokens=200)), watch)
        engine.start()
        assert two.wait(30)
        nxt = coord.steps.next_step
        for step in range(nxt, nxt + 20):
            coord.ranks.ranks[1].worker.inject_fault(step, "fail")
        end = sink.wait(["r"])["r"]
        engine.close()
    finally:
        coord.close()
    assert isinstance(end, Failed) and isinstance(end.error, GenerationFailed)
    assert end.error.retryable and "recovery was stopped" in str(end.error)
    assert 2 <= len(sink.tokens("r")) < 200
    assert engine.stats()["failed"] == 1


def test_a_hung_rank_pauses_the_streams_and_changes_no_token():
    """Thread ranks, recovery on: rank 1 hangs in a step (longer than the collective
    timeout); the group is rebuilt and every request ends with an undisturbed run's
    tokens, each token sent once."""
    cfg = dataclasses.replace(
        group_config(),
        timeout_s=2.0,
        coordinator=CoordinatorConfig(step_timeout_s=10.0, probe_s=1.0),
    )
    coord = start_local_group(cfg, worker_cls=DrillWorker)
    try:
        engine = Engine(coord, EngineConfig(step_tokens=16, recovery_wait_s=60.0), vocab=64)
        ps = prompts(62, 3, 10, shared=4)
        sink = Collector()
        three = threading.Event()

        def watch(ev):
            sink(ev)
            if isinstance(ev, TokenOut) and ev.index == 2:
                three.set()

        for i, p in enumerate(ps):
            engine.submit(GenerateRequest(i, p, SamplingParams(max_new_tokens=16)), watch)
        engine.start()
        assert three.wait(30)
        coord.ranks.ranks[1].worker.inject_fault(coord.steps.next_step + 1, "sleep", 4.0)
        ends = sink.wait(range(3))
        engine.close()
        for i, p in enumerate(ps):
            assert isinstance(ends[i], Finished), ends[i]
            assert sink.tokens(i) == list(ends[i].tokens) == greedy_reference(p, 16)
        assert coord.stats()["recoveries"] == 1
        assert engine.stats()["recoveries"] >= 1
        nothing_held(coord)
    finally:
        coord.close()
