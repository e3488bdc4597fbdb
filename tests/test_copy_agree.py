"""The host tier's agreements without a running group: the coordinator's check of the
copy count the ranks agreed, and the start-up agreement of the pools' sizes refusing
pools the smallest rank cannot hold (before anything is allocated)."""

from __future__ import annotations

import pytest
import torch
from group_helpers import group_config

from tpcache.cache.errors import CacheError, HostTierError
from tpcache.coordinator.copy_agree import CopyCompletion
from tpcache.coordinator.step_check import odd_ranks
from tpcache.coordinator.step_types import Closed
from tpcache.workers.copysync import agree_pools
from tpcache.workers.ops import StepResult, encode
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


class _OneRank:
    """A group of one rank: a MIN over it is its own values (``agree_pools`` enters
    only ``all_min``)."""

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)


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
