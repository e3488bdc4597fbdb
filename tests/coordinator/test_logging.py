"""The coordinator's lines for an operator: a rank killed (which rank, its actor and node,
what was seen), the recovery that follows (started, done, which ranks were replaced), a
divergence naming the odd rank and the step, a failed step with recovery off; a served
coordinator's lines printed by ``tpcache serve``'s relay. Real Ray ranks for the kills
(a Ray kill, a SIGKILL), thread ranks (gloo) for the drills."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from drill_worker import DrillWorker
from test_faults import config, wait_dead, wait_gone

from tpcache.cli.log_options import LineRelay
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.coordinator.rank_seen import actor_id, node_address
from tpcache.frontend.service import serve, start_group, stop_served
from tpcache.workers.protocol import DivergenceError, LockstepError, RankFailure


def lines(caplog, level: int | None = None) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("tpcache") and (level is None or r.levelno == level)
    ]


def test_a_killed_rank_and_its_recovery_are_logged(ray_cluster, caplog) -> None:
    import ray

    caplog.set_level(logging.DEBUG, logger="tpcache")
    coord = start_group(config())
    try:
        started = lines(caplog, logging.DEBUG)
        where = [f"actor {actor_id(a)} on node " for a in coord.ranks.actors]
        node = node_address(coord.ranks.rank_nodes[1])
        assert [s.startswith(f"rank {r} started: {where[r]}") for r, s in enumerate(started)] == [
            True,
            True,
        ]
        caplog.clear()
        coord.admit("held", list(range(1, 40)))  # running when the rank dies
        coord.sync()
        step = coord.stats()["steps_sent"]  # the step the health check fails at
        pid = coord.ranks.call("pid")[1]
        ray.kill(coord.ranks.actors[1], no_restart=True)
        wait_dead(coord.ranks.actors[1])
        wait_gone(pid)
        with pytest.raises(RankFailure):
            coord.check_health()  # the ping finds it; the recovery runs at once
        warned = lines(caplog, logging.WARNING)
        failed = [w for w in warned if w.startswith(f"the TP group failed at step {step}: ")]
        assert len(failed) == 1, warned
        assert "rank 1 died: " in failed[0]
        assert f"(rank 1: {where[1]}{node})" in failed[0]
        assert failed[0].endswith("; 1 running request(s) lost; recovering it")
        assert "\n" not in failed[0] and len(failed[0]) < 800  # Ray's error, on one line
        replacing = [w for w in warned if w.startswith("replacing rank")]
        assert len(replacing) == 1 and replacing[0].startswith(f"replacing rank 1 ({where[1]}")
        assert "its actor is dead" in replacing[0]
        info = lines(caplog, logging.INFO)
        assert info[0] == (
            f"recovering the TP group (after step {step}): "
            "replacing dead or hung ranks, every cache starts empty"
        )
        assert info[1].startswith("the TP group recovered in ")
        assert info[1].endswith(
            f" s: rank(s) replaced: [1]; capacity {coord.mirror.sizes().capacity} tokens"
        )
        assert coord.stats()["recoveries"] == 1
    finally:
        coord.close()


def test_a_divergence_names_the_odd_rank_and_step(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = start_local_group(
        config(coordinator=CoordinatorConfig(auto_recover=False)), worker_cls=DrillWorker
    )
    try:
        coord.admit("a", list(range(1, 30)))
        coord.finish("a")
        coord.sync()
        step = coord.stats()["steps_sent"]
        coord.ranks.call_on(1, "inject_fault", step, "corrupt")
        coord.admit("b", list(range(1, 30)))  # its prefix hit differs on rank 1
        with pytest.raises(DivergenceError) as caught:
            coord.sync()
        assert caught.value.step == step and caught.value.odd_ranks == (1,)
        [error] = lines(caplog, logging.ERROR)
        assert error.startswith(f"divergence at step {step}: odd rank(s) [1]: ")
        assert error.endswith(
            "; 1 running request(s) lost; it stays down until recover() is called"
        )
        assert lines(caplog, logging.INFO) == []  # no recovery: it is off
        coord.recover()  # by hand
        info = lines(caplog, logging.INFO)
        assert info[0] == (
            f"recovering the TP group (after step {step}): replacing dead or hung ranks, "
            "every cache starts empty"
        )
        # Thread ranks that answer are kept: none replaced.
        assert info[1].startswith("the TP group recovered in ")
        assert " s: rank(s) replaced: none; capacity " in info[1]
    finally:
        coord.close()


def test_a_hung_rank_is_named_and_replaced(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = start_local_group(config(timeout_s=2.0), worker_cls=DrillWorker)
    try:
        coord.admit("a", list(range(1, 30)))
        coord.sync()
        step = coord.stats()["steps_sent"]
        coord.ranks.call_on(1, "inject_fault", step, "sleep", 8.0)
        with pytest.raises(LockstepError):
            coord.finish("a")
            coord.sync()
        [failed] = [w for w in lines(caplog, logging.WARNING) if w.startswith("the TP group")]
        assert failed.startswith(f"the TP group failed at step {step}: ")
        # Thread ranks check each step among themselves: what the step saw is the peer's
        # collective timing out; the replacement's line below names the hung rank.
        assert "Timed out waiting 2000ms" in failed, failed
        assert failed.endswith("; 0 running request(s) lost; recovering it")
        # Still asleep at the recovery's ping: replaced, and the line says what was seen.
        assert "replacing rank 1 (a thread of this process): no answer to a ping within 2 s" in (
            lines(caplog, logging.WARNING)
        )
        assert lines(caplog, logging.INFO)[-1].endswith(" s: rank(s) replaced: [1]; capacity 1024 tokens")  # fmt: skip
    finally:
        coord.close()


def test_a_rank_that_fails_a_step_is_named_and_recovery_by_hand_counts_the_lost(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpcache")
    coord = start_local_group(
        config(coordinator=CoordinatorConfig(auto_recover=False)), worker_cls=DrillWorker
    )
    try:
        coord.admit("a", list(range(1, 30)))
        coord.admit("held", list(range(40, 60)))  # running when the step fails
        coord.sync()
        step = coord.stats()["steps_sent"]
        coord.ranks.call_on(0, "inject_fault", step, "fail")
        with pytest.raises(RankFailure):
            coord.finish("a")
            coord.sync()
        [warned] = lines(caplog, logging.WARNING)
        assert warned.startswith(f"the TP group failed at step {step}: ")
        assert "rank 0 failed at op 0 (Finish): RuntimeError: planted failure" in warned
        assert warned.endswith("; 1 running request(s) lost; it stays down until recover() is called")  # fmt: skip
        caplog.clear()
        coord.recover()
        coord.admit("b", list(range(1, 30)))
        coord.admit("c", list(range(1, 20)))
        coord.sync()
        coord.recover()  # by hand on a healthy group: its running requests are lost
        assert lines(caplog, logging.INFO)[2] == (
            "recovering the TP group (asked by hand): replacing dead or hung ranks, every "
            "cache starts empty; 2 running request(s) lost"
        )
    finally:
        coord.close()


def test_a_served_coordinators_lines_are_printed_by_the_relay(ray_cluster, capsys) -> None:
    import ray

    actor = serve(config(), name="logs-relay", namespace="tpcache-tests", log_level="DEBUG")
    try:
        relay = LineRelay(actor)
        relay()
        started = capsys.readouterr().err.splitlines()
        # Its group's start, at DEBUG as asked: each rank, with its actor and node.
        assert [" DEBUG tpcache.coordinator: rank 0 started: actor " in line for line in started] == [True, False]  # fmt: skip
        assert " DEBUG tpcache.coordinator: rank 1 started: actor " in started[1]
        first = relay.buffer
        relay()  # nothing new: nothing printed again
        assert capsys.readouterr().err == ""
        # A relay that read another buffer (an actor since restarted) reads from line 0.
        stale = LineRelay(actor)
        stale.buffer, stale.next = "an-old-buffer", 12
        stale()
        assert capsys.readouterr().err.splitlines() == started
        pid = ray.get(actor.rank_pids.remote())[1]
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        # The service's health check (every 2 s) finds it and the group is rebuilt.
        err = ""
        deadline = time.monotonic() + 120
        while "the TP group recovered in" not in err:
            assert time.monotonic() < deadline, err
            time.sleep(0.5)
            relay()
            err += capsys.readouterr().err
        lines = err.splitlines()
        failed = [x for x in lines if " WARNING tpcache.coordinator: the TP group failed at " in x]
        assert len(failed) == 1 and "rank 1 " in failed[0] and "(rank 1: actor " in failed[0]
        assert any(" WARNING tpcache.coordinator: replacing rank 1 (actor " in x for x in lines)
        assert any(" INFO tpcache.coordinator: recovering the TP group (after step " in x for x in lines)  # fmt: skip
        assert " rank(s) replaced: [1]; capacity " in lines[-1]
        assert relay.buffer == first  # the same actor, read on from where it was
    finally:
        stop_served(actor, "logs-relay", "tpcache-tests")
