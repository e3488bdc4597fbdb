"""Coalescing: steps that close while every in-flight slot is taken wait in the
coordinator and go to the ranks together, one message per rank; each is still applied
in lockstep and checked on its own (real Ray ranks, gloo)."""

from __future__ import annotations

import dataclasses

import pytest
from drill_worker import DrillWorker
from group_helpers import group_config

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.frontend.service import start_group
from tpcache.workers.protocol import DivergenceError

SLEEP_S = 2.0  # a slow rank: long against a few admits, short against the suite


@pytest.fixture(scope="module")
def coord(ray_cluster):
    c = start_group(group_config(2), worker_cls=DrillWorker)
    yield c
    c.close()


def configured(coord, **kw):
    """``coord`` reset, in lockstep, with ``kw`` in its config (recovering at once)."""
    coord.config = dataclasses.replace(
        CoordinatorConfig(), auto_recover=True, step_timeout_s=30.0, **kw
    )
    coord.reset()
    coord.sync()
    return coord


def slow_rank_then_calls(coord, n: int) -> tuple[int, int]:
    """Rank 0 sleeps on the next step; then ``n`` one-call steps. Returns the steps and
    messages sent for them once synced."""
    s0, m0 = coord.stats()["steps_sent"], coord.stats()["messages_sent"]
    coord.ranks.call_on(0, "inject_fault", s0, "sleep", SLEEP_S)
    for i in range(n):
        coord.admit(f"r{i}", [7, 7, 7, 7, i + 1, i + 2])
    coord.sync()
    s = coord.stats()
    return s["steps_sent"] - s0, s["messages_sent"] - m0


def test_steps_wait_while_a_rank_is_slow_and_go_out_together(coord):
    c = configured(coord, max_inflight=1, coalesce=4)
    s0, d0 = c.stats()["steps_sent"], c.stats()["steps_done"]
    c.ranks.call_on(0, "inject_fault", s0, "sleep", SLEEP_S)
    c.admit("a", [1, 2, 3, 4, 5])  # sent at once: the only slot
    for i in range(3):
        c.admit(f"b{i}", [1, 2, 3, 4, 6 + i])
    stats = c.stats()
    assert stats["waiting"] == 3 and stats["inflight"] == 1  # the caller was not blocked
    assert stats["steps_sent"] == s0 + 1
    c.admit("b3", [1, 2, 3, 4, 9])  # the fourth waiting step: now it blocks, then sends
    stats = c.stats()
    assert stats["waiting"] == 0 and stats["inflight"] == 4
    c.sync()
    stats = c.stats()
    assert stats["steps_sent"] == s0 + 5 and stats["steps_done"] == d0 + 5
    assert stats["divergences"] == 0 and stats["running"] == 5
    for info in c.ranks.call("info"):
        assert info["last_step"] == s0 + 4  # every step applied, in order
    with c.batch():
        for rid in ("a", "b0", "b1", "b2", "b3"):
            c.finish(rid)
    c.sync()
    assert c.ranks.call("digest") == [c.mirror.digest()] * 2


def test_one_step_per_message_when_coalescing_is_off(coord):
    steps, messages = slow_rank_then_calls(configured(coord, max_inflight=1, coalesce=1), 5)
    assert steps == messages == 5
    steps, messages = slow_rank_then_calls(configured(coord, max_inflight=1, coalesce=8), 5)
    assert steps == 5 and messages == 2  # the slow one, then the four that waited
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2


def test_divergence_inside_a_coalesced_message_is_caught_at_its_step(coord):
    c = configured(coord, max_inflight=1, coalesce=4)
    c.admit("p", [1, 2, 3, 4, 5])
    c.finish("p")  # cached: the admits below hit it, the corrupted one cannot
    c.sync()
    s0 = c.stats()["steps_sent"]
    c.ranks.call_on(0, "inject_fault", s0, "sleep", SLEEP_S)
    c.ranks.call_on(1, "inject_fault", s0 + 2, "corrupt")
    recoveries = c.stats()["recoveries"]
    c.admit("a", [1, 2, 3, 4, 5])
    c.admit("b", [1, 2, 3, 4, 6])
    c.admit("c", [1, 2, 3, 4, 7])  # corrupted on rank 1, in the same message as b and d
    c.admit("d", [1, 2, 3, 4, 8])
    assert c.stats()["waiting"] == 3
    with pytest.raises(DivergenceError) as caught:
        c.sync()
    assert caught.value.step == s0 + 2
    assert caught.value.odd_ranks == (1,)
    assert c.stats()["recoveries"] == recoveries + 1
    assert c.stats()["waiting"] == 0 and c.stats()["inflight"] == 0
    assert c.admit("e", [1, 2, 3, 4, 5]).prefix_len == 0  # recovered: empty, in lockstep
    c.sync()
    assert c.ranks.call("digest") == [c.mirror.digest()] * 2


def test_health_check_sends_steps_that_wait(coord):
    """What ``tpcache serve``'s health thread relies on when frontends go quiet."""
    c = configured(coord, max_inflight=1, coalesce=8)
    s0, d0 = c.stats()["steps_sent"], c.stats()["steps_done"]
    c.ranks.call_on(0, "inject_fault", s0, "sleep", 1.0)
    c.admit("a", [1, 2, 3, 4, 5])
    c.admit("b", [1, 2, 3, 4, 6])
    assert c.stats()["waiting"] == 1
    assert c.check_health()
    stats = c.stats()
    assert stats["waiting"] == 0 and stats["inflight"] == 0
    assert stats["steps_sent"] == s0 + 2 and stats["steps_done"] == d0 + 2


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4", None])
def test_bad_coalesce_is_refused(bad):
    with pytest.raises(ValueError, match="coalesce"):
        CoordinatorConfig(coalesce=bad)
