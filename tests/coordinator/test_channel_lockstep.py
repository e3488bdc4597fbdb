"""The lockstep protocol on the step channel, where the ranks do not check each step's
digest with each other (``Step.peer_check`` off): the coordinator compares every rank's
digest with its mirror, and the hub fails a rank that lags its peers.

- a step that does not evict enters no collective on any rank; one that evicts enters
  exactly its agreement;
- a rank that failed at one step still enters the agreements of the steps after it, so
  a peer that went on (it had no check to stop it) is stopped at once by the failure
  sentinel instead of waiting out the collective timeout.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from drill_worker import DrillWorker
from group_helpers import group_config

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.frontend.service import start_group
from tpcache.workers.protocol import LockstepError

TIMEOUT_S = 30.0  # the collective timeout: a peer left waiting would take this long


@pytest.fixture(scope="module")
def coord(ray_cluster):
    cfg = group_config(
        2,
        capacity_tokens=64,
        timeout_s=TIMEOUT_S,
        coordinator=CoordinatorConfig(max_inflight=4, coalesce=1),
    )
    c = start_group(cfg, worker_cls=DrillWorker)
    yield c
    c.close()


def collectives(coord) -> list[int]:
    return [info["collectives"] for info in coord.ranks.call("info")]


def test_only_evicting_steps_enter_collectives(coord) -> None:
    coord.reset()
    coord.sync()
    assert coord.ranks.paths() == ["ipc", "ipc"]
    before = collectives(coord)
    coord.admit("a", list(range(1, 30)))
    coord.finish("a")
    coord.sync()
    assert collectives(coord) == before  # no eviction: no collective at all
    coord.admit("b", list(range(100, 160)))  # 60 tokens in 64: "a" is evicted
    coord.sync()
    assert coord.mirror.sizes().evictable == 0
    assert collectives(coord) == [n + 1 for n in before]  # the one agreement
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2
    coord.finish("b")
    coord.sync()


def test_a_failed_rank_enters_later_agreements(coord) -> None:
    """Rank 1 fails at step s (no agreement in it); step s+1, already sent, evicts. Rank
    0 applied s without hearing of the failure and enters s+1's agreement: rank 1 must
    enter it too, with the failure sentinel. Before it did (it refused s+1 as out of
    order, entering nothing), rank 0 sat in that agreement until the collective timeout,
    busy: seen here with recovery off (a recovery tears the old group down, which frees
    it sooner)."""
    coord.config = dataclasses.replace(coord.config, auto_recover=False)
    coord.reset()
    coord.admit("a", list(range(1, 30)))
    coord.finish("a")
    coord.sync()
    step = coord.stats()["steps_sent"]
    coord.ranks.call_on(1, "inject_fault", step, "fail")
    with pytest.raises(LockstepError) as caught:
        coord.admit("c", [7, 8, 9])  # step s: fails on rank 1
        coord.admit("d", list(range(200, 250)))  # step s+1: evicts "a", an agreement
        coord.sync()
    assert "planted failure" in str(caught.value), caught.value
    assert caught.value.step == step
    deadline = time.monotonic() + TIMEOUT_S / 3
    while (busy := [b for _, b, _ in coord.ranks.call("health")]) != [0.0, 0.0]:
        assert time.monotonic() < deadline, f"a rank still busy in a step: {busy}"
        time.sleep(0.1)
    infos = coord.ranks.call("info")
    assert [i["last_step"] for i in infos] == [step, step - 1]  # rank 0 applied s only
    coord.recover()
    coord.config = dataclasses.replace(coord.config, auto_recover=True)
    coord.admit("e", [1, 2, 3, 4, 5])
    coord.sync()
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2
