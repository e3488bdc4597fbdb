"""The engine's lines for an operator: it goes on once its group is back after a failed
step, or gives up on a group that stays down (its live requests fail). A real model on
thread ranks (gloo), failures planted by the drill worker."""

from __future__ import annotations

import logging
import re
import threading

from conftest import Collector, group_config
from drill_worker import DrillWorker

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.engine.requests import Failed, Finished, GenerateRequest, SamplingParams, TokenOut


def engine_lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tpcache.engine" and r.levelno == level]  # fmt: skip


def run_until_second_token(coord, sink: Collector) -> Engine:
    engine = Engine(coord, EngineConfig(recovery_wait_s=30.0), vocab=64)
    two = threading.Event()

    def watch(ev):
        sink(ev)
        if isinstance(ev, TokenOut) and ev.index == 1:
            two.set()

    engine.submit(GenerateRequest("r", (1, 2, 3), SamplingParams(max_new_tokens=40)), watch)
    engine.start()
    assert two.wait(30)
    return engine


def test_the_engine_says_when_it_goes_on(caplog) -> None:
    """Recovery on, in the background (as served): the engine waits, then goes on."""
    caplog.set_level(logging.INFO, logger="tpcache")
    cfg = group_config(coordinator=CoordinatorConfig(recover_in_background=True))
    coord = start_local_group(cfg, worker_cls=DrillWorker)
    try:
        sink = Collector()
        engine = run_until_second_token(coord, sink)
        coord.ranks.ranks[1].worker.inject_fault(coord.steps.next_step, "fail")
        end = sink.wait(["r"])["r"]
        engine.close()
    finally:
        coord.close()
    assert isinstance(end, Finished) and end.recoveries == 1
    [went_on] = engine_lines(caplog, logging.INFO)
    assert re.fullmatch(r"the engine goes on: its TP group is back after \d+\.\d s", went_on)
    assert engine_lines(caplog, logging.ERROR) == []


def test_the_engine_says_when_it_gives_up(caplog) -> None:
    """Recovery off: the group stays down, and the engine's line says its requests fail."""
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = start_local_group(group_config(), worker_cls=DrillWorker)
    try:
        sink = Collector()
        engine = run_until_second_token(coord, sink)
        nxt = coord.steps.next_step
        for step in range(nxt, nxt + 20):
            coord.ranks.ranks[1].worker.inject_fault(step, "fail")
        end = sink.wait(["r"])["r"]
        engine.close()
    finally:
        coord.close()
    assert isinstance(end, Failed)
    [gave_up] = engine_lines(caplog, logging.ERROR)
    assert gave_up.startswith(
        "the engine gives up on its TP group, its live requests fail: the TP group is down "
        "and its recovery was stopped ("
    )
    assert "\n" not in gave_up
