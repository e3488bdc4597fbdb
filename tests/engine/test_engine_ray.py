"""Surviving a rank: on real Ray rank actors at TP=2, one rank's process is killed
(SIGKILL) while several requests generate greedily. The coordinator rebuilds the group;
the engine re-admits every request with its prompt + the tokens already sent, and each
ends with exactly the tokens of an undisturbed run, every token sent once."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from conftest import MODEL, Collector, greedy_reference, group_config, prompts
from runner_doubles import REFUSED_ON_RANK_1

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.step_types import RankCallError
from tpcache.engine.forward import ModelEngine
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import Finished, GenerateRequest, SamplingParams, TokenOut
from tpcache.frontend.service import start_group
from tpcache.model.context import ForwardError


def test_a_rank_killed_mid_generation_changes_no_token(ray_cluster):
    cfg = group_config(
        capacity=512,
        timeout_s=4.0,  # a peer's collective notices fast
        join_timeout_s=120.0,  # a replacement actor may start slowly on a busy machine
        coordinator=CoordinatorConfig(step_timeout_s=30.0, probe_s=2.0),
    )
    coord = start_group(cfg)
    try:
        pids = coord.ranks.call("pid")
        engine = Engine(coord, EngineConfig(step_tokens=32, timeout_s=30.0, recovery_wait_s=90.0))
        ps = prompts(51, 3, 14, shared=4)
        n = 32
        sink = Collector()
        five = threading.Event()

        def watch(ev):
            sink(ev)
            if isinstance(ev, TokenOut) and ev.index == 4:
                five.set()

        for i, p in enumerate(ps):
            engine.submit(GenerateRequest(i, p, SamplingParams(max_new_tokens=n)), watch)
        engine.start()
        assert five.wait(60)
        os.kill(pids[1], signal.SIGKILL)
        ends = sink.wait(range(3), timeout=120)
        engine.close()
        for i, p in enumerate(ps):
            assert isinstance(ends[i], Finished), ends[i]
            assert sink.tokens(i) == list(ends[i].tokens) == greedy_reference(p, n)
        st = engine.stats()
        print(st, coord.stats()["last_recovery_s"])
        assert st["recoveries"] >= 1 and coord.stats()["recoveries"] == 1
        assert sum(ends[i].recoveries for i in range(3)) == st["recoveries"]
        assert coord.ranks.call("pid")[1] != pids[1]
    finally:
        coord.close()


def test_a_forward_one_rank_refuses_runs_on_no_rank(ray_cluster):
    """On the step channel the coordinator agrees a forward's verdict itself (no
    collective): a batch rank 1 alone refuses fails with that rank named, no rank
    computes it (rank 0 would otherwise wait in the runner's collectives for ever), and
    the group serves the next batch."""
    cfg = group_config(runner="runner_doubles:OneRankRefuses")
    coord = start_group(cfg)
    try:
        assert not coord.ranks.peer_check  # the step channel
        engine = ModelEngine(coord, timeout_s=30.0)
        before = [t["forwards"] for t in coord.ranks.call("model_times")]
        with pytest.raises(RankCallError, match="refused on rank 1") as err:
            engine.admit("bad", [1, 2, REFUSED_ON_RANK_1, 4])
        assert err.value.rank == 1 and isinstance(err.value.cause, ForwardError)
        assert [t["forwards"] for t in coord.ranks.call("model_times")] == before
        coord.abort("bad")
        prefix, out = engine.admit("good", [1, 2, 3, 4, 5])
        assert prefix == 0 and out.logits.shape == (5, MODEL.vocab)
        assert [t["forwards"] for t in coord.ranks.call("model_times")] == [n + 1 for n in before]
        engine.finish("good")
        coord.sync()
    finally:
        coord.close()
