"""The host tier's agreements without a running group: the coordinator's check of the
copy count the ranks agreed, the start-up agreement of the pools' sizes refusing pools
the smallest rank cannot hold (before anything is allocated), and a forward's bounded
wait for its own rank's write-backs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from group_helpers import group_config
from model_helpers import ThreadGroup, ThreadMember

from tpcache.cache.errors import CacheError, HostTierError
from tpcache.cache.host.config import HostCopy
from tpcache.coordinator.copy_agree import CopyCompletion
from tpcache.coordinator.step_check import odd_ranks
from tpcache.coordinator.step_types import Closed
from tpcache.kv.host_copy import CopyEngineClosed
from tpcache.kv.pool import KVPool, PoolSpec
from tpcache.lockstep.ops import CopySync, StepResult, encode
from tpcache.model.context import ForwardError
from tpcache.workers.copysync import RankCopies, agree_pools, sync_copies
from tpcache.workers.rank import CacheSpec

PAGE = 4


def test_a_rank_whose_agreed_copy_count_differs_is_odd() -> None:
    """A MIN gives every rank the same count: a rank reporting another one diverged,
    and the count is not taken from that step."""
    copies = CopyCompletion()
    step = Closed(4, b"", 99, [], 0.0)
    same = [encode(StepResult(4, r, 99, [], copies_done=5)) for r in range(3)]
    assert odd_ranks(step, same, copies)[0] == [] and copies.agreed == 5
    split = [encode(StepResult(4, r, 99, [], copies_done=n)) for r, n in enumerate([6, 6, 4])]
    assert odd_ranks(step, split, copies)[0] == [2] and copies.agreed == 5
    none_ran = [encode(StepResult(4, r, 99, [])) for r in range(3)]  # copies_done -1
    assert odd_ranks(step, none_ran, copies)[0] == [] and copies.agreed == 5


def machine_free(monkeypatch: pytest.MonkeyPatch, free: Callable[[], int]) -> None:
    """The machine's free memory, as the OS reports it to this process, is ``free()``
    bytes (available pages of one byte each)."""
    real = os.sysconf

    def sysconf(name: str | int) -> int:
        if name == "SC_AVPHYS_PAGES":
            return free()
        return 1 if name == "SC_PAGE_SIZE" else real(name)

    monkeypatch.setattr(os, "sysconf", sysconf)


class _OneRank:
    """A group of one rank: a MIN over it is its own values, a gather its own list."""

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


class _TwoHere(_OneRank):
    """Two ranks on this machine that see the same: a gather gives its list twice."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values), list(values)]


class _TwoApart(_OneRank):
    """Two ranks on two machines: the other's key is another."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values), [values[0] ^ 1]]


def test_ranks_on_one_machine_share_its_free_memory(monkeypatch) -> None:
    """Each rank checks the host pool against free memory: two ranks on one machine may
    count on half of it each (they each counted on all of it, and together could take
    twice what is there); ranks on two machines on all of theirs."""
    cache = CacheSpec(page_size=PAGE, policy="lru", host_capacity_tokens=60 * PAGE)
    spec = group_config(2, capacity_tokens=4 * PAGE, cache=cache).worker_spec()
    free = 100 * PAGE * spec.pool.bytes_per_slot  # room for 100 pages
    machine_free(monkeypatch, lambda: free)
    cpu = torch.device("cpu")
    assert agree_pools(_OneRank(), spec, cpu) == (4 * PAGE, 60 * PAGE)
    assert agree_pools(_TwoApart(), spec, cpu) == (4 * PAGE, 60 * PAGE)
    with pytest.raises(HostTierError, match="holds 200 tokens on the smallest rank, 240"):
        agree_pools(_TwoHere(), spec, cpu)


@pytest.mark.parametrize(
    "kw, error, what",
    [
        (dict(capacity_tokens=None, cpu_budget_bytes=1), CacheError, "less than a page"),
        (
            dict(cache=CacheSpec(page_size=PAGE, policy="lru", host_capacity_tokens=1 << 60)),
            HostTierError,
            "host pool holds .* on the smallest rank",
        ),
    ],
)
def test_pools_the_smallest_rank_cannot_hold_are_refused(kw, error, what) -> None:
    spec = group_config(2, **kw).worker_spec()
    with pytest.raises(error, match=what):
        agree_pools(_OneRank(), spec, torch.device("cpu"))


def test_pools_that_fit_are_agreed_in_whole_pages() -> None:
    cache = CacheSpec(page_size=PAGE, policy="lru", host_capacity_tokens=4 * PAGE + 3)
    spec = group_config(2, capacity_tokens=6 * PAGE + 1, cache=cache).worker_spec()
    assert agree_pools(_OneRank(), spec, torch.device("cpu")) == (6 * PAGE, 4 * PAGE)


class _LocalWaits:
    """What ``RankCopies.before_forward`` reads of a cache's host part: the copies each
    request's forward must not overtake on this rank (``HostPart.local_after``)."""

    def __init__(self, after: dict[str, int]) -> None:
        self.after = after

    def local_after(self, rid: str) -> int:
        return self.after.get(rid, 0)


def test_a_forward_whose_write_backs_are_not_done_here_is_refused_in_time() -> None:
    pool = KVPool(
        PoolSpec(num_layers=1, kv_heads=2, head_dim=4, tp=1), 4 * PAGE, torch.device("cpu")
    )
    copies = RankCopies(pool, 4 * PAGE, PAGE)
    try:
        copies.before_forward(_LocalWaits({"a": 1}), ["b"], 0.0)  # "b" waits for none
        copies.drill(1.0, [])  # the write-back below takes a second
        copies.submit([HostCopy(0, True, np.array([1]), np.array([0]))])
        start = time.monotonic()
        with pytest.raises(ForwardError, match="reached 0 of the 1"):
            copies.before_forward(_LocalWaits({"a": 1}), ["b", "a"], 0.05)
        assert time.monotonic() - start < 0.9
        copies.before_forward(_LocalWaits({"a": 1}), ["a"], 30.0)  # done in time
        assert copies.local_done() == 1
    finally:
        copies.close()


def test_a_closed_rank_copies_count_is_never_agreed() -> None:
    """A rank closes its copies when it rebuilds its cache, dropping the queued ones: a
    step or a forward that still holds them must fail at once (-1 through the MIN, a
    refused forward), not wait for copies that never come nor agree the count they left."""
    pool = KVPool(
        PoolSpec(num_layers=1, kv_heads=2, head_dim=4, tp=1), 4 * PAGE, torch.device("cpu")
    )
    copies = RankCopies(pool, 4 * PAGE, PAGE)
    copies.submit([HostCopy(0, True, np.array([1]), np.array([0]))])
    assert copies.engine.wait(1, 10.0) and copies.local_done() == 1
    copies.drill(1.0, [])
    copies.submit([HostCopy(1, True, np.array([2]), np.array([1]))])
    start = time.monotonic()
    copies.close()
    group = ThreadMember(ThreadGroup(1), 0)
    assert sync_copies(group, copies, True, CopySync(want=2, wait_s=30.0)) == -1
    with pytest.raises(ForwardError, match="reached 1 of the 2"):
        copies.before_forward(_LocalWaits({"a": 2}), ["a"], 30.0)
    assert time.monotonic() - start < 0.9  # the second copy took a second: it was dropped
    with pytest.raises(CopyEngineClosed):
        copies.submit([HostCopy(2, True, np.array([3]), np.array([2]))])


def test_a_failing_copy_is_never_counted_done_while_it_finishes() -> None:
    """A rank's done count is -1 from the moment a copy fails, however the engine's
    thread and the reader interleave: the failure and the count it bumps are read under
    the engine's one lock (read apart, a failure that landed between the two reads was
    counted as done, and MIN let the group use the pages). Many short races; the old
    two reads lost about one in sixteen here."""
    import sys

    import numpy as np
    import torch

    from tpcache.cache.host.config import HostCopy
    from tpcache.kv.pool import KVPool, PoolSpec
    from tpcache.workers.copysync import RankCopies

    dev = KVPool(PoolSpec(1, 1, 1, 1, "float32"), 64, torch.device("cpu"))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch as often as they can
    try:
        for _ in range(200):
            rc = RankCopies(dev, 64, 1)
            rc.engine.fail = frozenset({0})
            rc.engine.delay_s = 0.0005
            rc.submit([HostCopy(0, True, np.array([1]), np.array([1]))])
            seen = []
            while rc.engine.done() < 1:
                seen.append(rc.local_done())
            seen.append(rc.local_done())
            rc.close()
            assert all(v <= 0 for v in seen) and seen[-1] == -1, seen
    finally:
        sys.setswitchinterval(switch)


def test_a_second_setup_reads_free_memory_after_the_old_host_pool_is_gone(monkeypatch) -> None:
    """A recovery sets a rank up again: its free memory must be read once the old host
    pool is let go, or that pool counts against the new one (a red team's rank with a
    pool over half the free memory started, then failed every recovery)."""
    import weakref

    from tpcache.workers.rank import RankWorker

    cache = CacheSpec(page_size=PAGE, policy="lru", host_capacity_tokens=8 * PAGE)
    worker = RankWorker(0, group_config(1, capacity_tokens=4 * PAGE, cache=cache).worker_spec())
    worker.group = _OneRank()  # type: ignore[assignment]
    assert worker.setup() == 4 * PAGE
    old = worker.copies
    assert old is not None
    gone = weakref.ref(old.host)
    del old
    seen: list[bool] = []
    real = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def probe() -> int:  # the real reading, and whether the old host pool was gone then
        seen.append(gone() is None)
        return real

    machine_free(monkeypatch, probe)
    assert worker.setup() == 4 * PAGE
    assert seen == [True]
    assert worker.copies is not None and worker.copies.host is not None
