"""The lockstep checks that only an integration run exercises (#20 item 11), on a TP=2
group of in-process ranks (real gloo):

- the coordinator compares every rank's digest and results with its mirror's: when every
  rank goes wrong the same way, the ranks' own digest all-reduce agrees, and only this
  comparison catches it (naming every rank);
- a rank that fails locally before an agreement sends the failure sentinel through the
  same MIN, so every rank stops at that agreement, not later.
"""

from __future__ import annotations

import pytest
from drill_worker import DrillWorker

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.workers.protocol import DivergenceError, RankFailure
from tpcache.workers.spec import CacheSpec

PROMPT = list(range(1, 41))


@pytest.fixture()
def coord():
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=128,
        cache=CacheSpec(page_size=4, max_request_tokens=96),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 20,
        timeout_s=20.0,
        coordinator=CoordinatorConfig(auto_recover=False),
    )
    c = start_local_group(cfg, worker_cls=DrillWorker)
    yield c
    c.close()


def test_the_same_corruption_on_every_rank_is_caught_by_the_coordinator(coord) -> None:
    coord.admit("a", PROMPT)
    coord.finish("a")
    coord.sync()
    step = coord.stats()["steps_sent"]
    coord.ranks.call("inject_fault", step, "corrupt")  # every rank, the same tamper
    coord.admit("b", [*PROMPT, 7])  # ranks match a shorter prefix than the mirror
    with pytest.raises(DivergenceError) as caught:
        coord.sync()
    assert caught.value.odd_ranks == (0, 1)
    assert caught.value.step == step
    # The ranks agree with each other: their own check could not see it.
    digests = coord.ranks.call("digest")
    assert digests[0] == digests[1] != coord.mirror.digest()


def test_a_local_failure_stops_every_rank_at_the_next_agreement(coord) -> None:
    """Rank 1's first op fails; the step's second op evicts, so every rank enters its
    agreement. Through MIN rank 1's -1 reaches rank 0, which stops there: it never admits
    the second request. (Were the agreement a MAX, rank 0 would go on and admit it, and
    hear of the failure only at the digest check.)"""
    coord.admit("a", PROMPT)
    coord.finish("a")
    coord.admit("b", [*range(500, 540)])
    coord.finish("b")
    coord.sync()
    step = coord.stats()["steps_sent"]
    coord.ranks.workers[1].inject_fault(step, "fail")
    with coord.batch():
        coord.admit("c", [*range(900, 940)])  # rank 1 fails here
        coord.admit("d", [*range(700, 760)])  # needs an eviction: an agreement
    with pytest.raises(RankFailure) as caught:
        coord.sync()
    # Named by the rank where it failed, not by the peer that only heard of it.
    assert "rank 1 failed at op 0 (Admit): RuntimeError: planted failure" in str(caught.value)
    r0, r1 = coord.ranks.workers
    assert "d" not in r0.cache.running_ids()  # stopped at the agreement
    assert "c" in r0.cache.running_ids() and "c" not in r1.cache.running_ids()
