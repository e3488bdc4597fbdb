"""The host tier across TP ranks: Ray ranks on the step channel, each with its own
host pool shard and copy engine, agree how many copies are done by MIN; the completion
enters the op log as an op, so every rank and the mirror change at the same step (the
coordinator compares every rank's digest with the mirror's after every step)."""

from __future__ import annotations

import dataclasses
import random
import urllib.request

import numpy as np
import pytest
from drill_worker import DrillWorker
from group_helpers import group_config

from tpcache.cache.errors import HostTierError
from tpcache.cache.namespace import CacheNamespace
from tpcache.coordinator.copy_agree import CopiesNotDone
from tpcache.frontend.api import AdmitCall, AdmitReply, CachedReply, FinishCall
from tpcache.frontend.frontend import dispatch
from tpcache.frontend.service import start_group
from tpcache.harness.demo import DemoRequest, run_demo
from tpcache.model.context import ForwardError, build_forward
from tpcache.workers.protocol import RankFailure
from tpcache.workers.rank import CacheSpec

PAGE = 4


def host_config(**kw):
    spec = dict(page_size=PAGE, policy="lru", max_request_tokens=256, host_capacity_tokens=256)
    spec.update(kw)
    return group_config(2, capacity_tokens=64, cache=CacheSpec(**spec))


@pytest.fixture(scope="module")
def group(ray_cluster):
    cfg = dataclasses.replace(host_config(), metrics_port=0)
    coord = start_group(cfg, worker_cls=DrillWorker)
    yield coord
    coord.close()


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, more than the 64-token device pool holds."""
    print("seed", seed)
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 500) for _ in range(24)] for _ in range(5)]
    return [rng.choice(heads) + [rng.randrange(1, 500) for _ in range(5)] for _ in range(n)]


def copies(coord) -> list[list[int]]:
    """Per rank: copies started, agreed done, done by its own engine."""
    return [info["copies"] for info in coord.ranks.call("info")]


def test_a_slow_rank_holds_back_completion_at_the_same_step_everywhere(group) -> None:
    coord = group
    coord.ranks.call_on(1, "copy_drill", 0.02, [])
    held_back = loaded = 0
    for i, p in enumerate(prompts(7, 24)):
        got = coord.admit(i, p)
        loaded += got.host_hit_length
        coord.sync()  # every step so far checked: each rank's digest == the mirror's
        mirror = coord.mirror
        per_rank = copies(coord)
        # Every rank knows exactly what the mirror knows: the same started and agreed.
        assert {(s, a) for s, a, _ in per_rank} == {
            (mirror.host.counts()["copies_started"], mirror.host.copies_completed())
        }
        # Rank 0 (fast) has done copies the group has not agreed yet: rank 1 holds it back.
        held_back += per_rank[0][2] > per_rank[0][1] and per_rank[1][2] < per_rank[0][2]
        if not mirror.host.request_ready(i):
            with pytest.raises(ForwardError, match="waits for"):
                build_forward(mirror, i, p[-1:])
        coord.wait_ready([i], 20.0)
        assert mirror.host.request_ready(i)
        build_forward(mirror, i, p[-1:])  # now it may run
        coord.finish(i)
    coord.sync()
    assert loaded > 0 and held_back > 0
    assert coord.stats()["divergences"] == 0 and coord.stats()["rank_failures"] == 0
    coord.ranks.call("check_integrity")
    coord.mirror.check_integrity()
    # A frontend's engine runs its forward when it gets the slots: the reply waits.
    for j, p in enumerate(prompts(17, 6)):
        reply = dispatch(coord, AdmitCall(1000 + j, p))
        assert isinstance(reply, AdmitReply) and coord.mirror.host.request_ready(1000 + j)
        assert isinstance(dispatch(coord, FinishCall(1000 + j, [])), CachedReply)
    coord.ranks.call_on(1, "copy_drill", 0.0, [])


def test_a_copy_that_fails_on_one_rank_fails_everywhere_and_nothing_leaks(group) -> None:
    coord = group
    coord.reset()
    coord.sync()
    started = coord.mirror.host.counts()["copies_started"]
    coord.ranks.call_on(1, "copy_drill", 0.0, [started + 2])
    failures = []
    for i, p in enumerate(prompts(8, 16)):
        try:
            coord.admit(100 + i, p)
            coord.wait_ready([100 + i], 20.0)
            coord.finish(100 + i)
        except RankFailure as exc:
            failures.append(str(exc))
    assert len(failures) == 1 and "host copy failed" in failures[0], failures
    # Named after the rank whose copy failed, not a peer that heard of it by the MIN.
    assert "rank 1 failed" in failures[0] and "rank 0 failed" not in failures[0], failures
    assert failures[0].count("step ") == 1, failures  # the step is named once
    stats = coord.stats()
    assert stats["recoveries"] == 1 and stats["divergences"] == 0
    coord.sync()
    # Recovered: every rank and the mirror start over with a fresh copy log and engine,
    # and the pools account for every page (device and host conservation).
    mirror = coord.mirror
    coord.wait_ready(mirror.running_ids(), 20.0)
    assert {tuple(c) for c in copies(coord)} == {(mirror.host.counts()["copies_started"],) * 3}
    coord.ranks.call("check_integrity")
    mirror.check_integrity()
    assert [i["digest"] for i in coord.ranks.call("info")] == [mirror.digest()] * 2


def test_a_forward_that_waits_too_long_is_refused_in_time(group) -> None:
    coord = group
    coord.reset()
    coord.sync()
    heads = [[100 * h + k + 1 for k in range(24)] for h in range(3)]
    for i, head in enumerate(heads):  # 3 x 29 tokens through 64: the first goes to the host
        coord.admit(200 + i, [*head, 7, 8, 9, 10, 11])
        coord.wait_ready([200 + i], 20.0)
        coord.finish(200 + i)
    coord.sync()
    coord.ranks.call_on(0, "copy_drill", 1.0, [])
    failures = coord.stats()["rank_failures"]
    got = coord.admit(205, [*heads[0], 1, 2, 3])  # its forward reads what is being loaded
    assert got.host_hit_length > 0 and got.ready_after > coord.mirror.host.copies_completed()
    with pytest.raises(CopiesNotDone, match="waits for"):
        coord.wait_ready([205], 0.05)
    assert coord.stats()["rank_failures"] == failures and coord.mirror.running_ids() == [205]
    assert not coord.mirror.host.request_ready(205)
    coord.ranks.call_on(0, "copy_drill", 0.0, [])
    coord.wait_ready([205], 30.0)
    coord.finish(205)
    coord.sync()


def test_namespaces_on_the_host_tier_stay_in_lockstep(group) -> None:
    """Tenants' salts and an adapter over the host tier, across the ranks: equal prompts
    in different namespaces never hit each other's KV on either tier, every rank's
    digest equals the mirror's after every step, and the ranks' trees check out."""
    coord = group
    coord.reset()
    coord.sync()
    before = coord.stats()
    spaces = [None, CacheNamespace(salt="t1"), CacheNamespace(lora_id=2, lora_name="x")]
    loaded = {i: 0 for i in range(3)}
    for i, p in enumerate(prompts(31, 30)):
        k = i % 3
        got = coord.admit(500 + i, p, namespace=spaces[k])
        loaded[k] += got.host_hit_length
        coord.wait_ready([500 + i], 20.0)
        coord.finish(500 + i)
    coord.sync()
    assert sum(loaded.values()) > 0
    # The first prompt in a namespace that never saw it: no hit on any tier.
    fresh = CacheNamespace(salt="t2")
    assert coord.mirror.admit_prefix_len(prompts(31, 1)[0], fresh) == 0  # (pure)
    assert coord.admit(600, prompts(31, 1)[0], namespace=fresh).prefix_len == 0
    coord.finish(600)
    coord.sync()
    stats = coord.stats()
    assert stats["divergences"] == before["divergences"]
    assert stats["rank_failures"] == before["rank_failures"]
    coord.ranks.call("check_integrity")
    coord.mirror.check_integrity()
    assert [i["digest"] for i in coord.ranks.call("info")] == [coord.mirror.digest()] * 2


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        name: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for name, _, value in [line.rpartition(" ")]
    }


def test_stats_and_metrics_show_the_host_tier(group) -> None:
    """What the host tier did is in ``stats()`` and the metrics, as the mirror counts it:
    the host hits are exactly the tokens the admits reported loaded, and the host pool's
    figures add up to its capacity."""
    coord = group
    before = coord.stats()
    loaded = hits = 0
    for i, p in enumerate(prompts(21, 20)):
        got = coord.admit(300 + i, p)
        loaded += got.host_hit_length
        hits += got.prefix_len
        coord.wait_ready([300 + i], 20.0)
        coord.finish(300 + i)
    coord.sync()
    stats = coord.stats()
    tier = coord.mirror.host.stats()
    assert loaded > 0 and stats["host_hit_tokens"] - before["host_hit_tokens"] == loaded
    assert stats["hit_tokens"] - before["hit_tokens"] == hits >= loaded
    assert stats["written_back_tokens"] > before["written_back_tokens"]
    assert stats["written_back_tokens"] == tier.written_tokens
    assert stats["host_evicted_tokens"] == tier.host_evicted_tokens
    assert stats["host_capacity"] == 256 == tier.sizes.capacity
    total = stats["host_free"] + stats["host_evictable"] + stats["host_protected"]
    assert total == stats["host_capacity"] and stats["host_evictable"] > 0
    # (Copies the last steps started are agreed done at a later step: some may pend.)
    assert stats["copies_pending"] == coord.mirror.host.copies_pending() == tier.copies_pending
    m = scrape(coord.metrics_port)
    assert m["tpcache_host_hit_tokens_total"] == stats["host_hit_tokens"]
    assert m["tpcache_host_written_tokens_total"] == stats["written_back_tokens"]
    assert m["tpcache_host_evicted_tokens_total"] == stats["host_evicted_tokens"]
    assert m["tpcache_host_capacity_tokens"] == 256
    assert m["tpcache_host_free_tokens"] == stats["host_free"]
    assert m["tpcache_host_evictable_tokens"] == stats["host_evictable"]
    assert m["tpcache_host_copy_tokens"] == stats["host_protected"]
    assert m["tpcache_host_copies_pending"] == stats["copies_pending"]


def test_the_demo_splits_its_hits_by_tier(group) -> None:
    """``run_demo`` on a coordinator that ran before (its counters are not the run's):
    each run's matched tokens split into device and host hits, the host ones exactly
    what the mirror loaded during that run, whatever ran before it."""
    coord = group
    coord.reset()
    coord.sync()
    chat = [
        DemoRequest(400 + i, np.array(p, dtype=np.int32), np.array([1, 2], dtype=np.int32))
        for i, p in enumerate(prompts(23, 40))
    ]
    for run in range(2):
        tier = coord.mirror.host.stats()
        requests = [dataclasses.replace(r, rid=r.rid + 100 * run) for r in chat]
        got = run_demo(coord, requests, batch=1)
        after = coord.mirror.host.stats()
        assert got["lockstep_verified"] and got["host_capacity_tokens"] == 256
        assert got["host_hit_tokens"] == after.loaded_tokens - tier.loaded_tokens > 0
        assert got["written_back_tokens"] == after.written_tokens - tier.written_tokens > 0
        assert got["host_evicted_tokens"] == after.host_evicted_tokens - tier.host_evicted_tokens
        assert got["device_hit_tokens"] == got["matched_tokens"] - got["host_hit_tokens"] > 0
        assert got["loaded_tokens"] == got["host_hit_tokens"]
    assert tier.loaded_tokens > 0  # the second run's counters did not start from zero


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(host_capacity_tokens=PAGE - 1), "host_capacity_tokens must be"),
        (dict(host_capacity_tokens=64, sliding_window=8), "no host tier"),
        (dict(host_capacity_tokens=64, policy="resight"), "has no host tier"),
        (dict(host_capacity_tokens=64, write_policy="write_around"), "unknown write policy"),
    ],
)
def test_bad_host_tier_is_refused_before_any_rank_starts(kw, what) -> None:
    with pytest.raises(HostTierError, match=what):
        host_config(**kw)


def test_the_demo_says_why_a_group_refused_to_start(ray_cluster, capsys) -> None:
    """A host pool larger than any rank can hold is refused by the ranks' start-up
    agreement: ``tpcache demo`` prints which rank refused and why, and fails (it used to
    end in a traceback)."""
    from tpcache.cli import main

    rc = main(["demo", "--tp", "2", "--capacity", "20000", "--host-capacity", str(10**14)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "the group did not start" in err and "HostTierError" in err and "Traceback" not in err
