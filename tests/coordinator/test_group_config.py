"""``GroupConfig`` refuses what cannot place or reach a group, with a ``ValueError`` that
says what was wrong, when it is made (before ``start_group`` binds an endpoint or
starts a rank); and a group's step paths say when it has none."""

from __future__ import annotations

import math

import pytest

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.ranks import RayRanks


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"tp": 0}, "tp must be an int >= 1"),
        ({"tp": -2, "rank_resources": {"node_a": 1}}, "tp must be"),
        ({"tp": 0, "rank_resources": []}, "tp must be"),
        ({"tp": True}, "tp must be"),
        ({"tp": 2.0}, "tp must be"),
        ({"use_gpus": "no"}, "use_gpus must be True, False or None"),
        ({"use_gpus": 0.5}, "use_gpus must be"),
        ({"strategy": "spread"}, "strategy must be one of"),
        ({"transport": "shm"}, "transport must be one of"),
        ({"gpus_per_rank": 0}, "gpus_per_rank"),
        ({"rank_resources": {"node_a": math.inf}}, "finite amounts > 0"),
        ({"rank_resources": {"node_a": math.nan}}, "finite amounts > 0"),
        ({"rank_resources": {"node_a": 0}}, "finite amounts > 0"),
        ({"rank_resources": {"GPU": 1}}, "custom resource names"),
        ({"rank_resources": {"": 1}}, "custom resource names"),
        ({"rank_resources": [{"node_a": 1}]}, "lists 1 dicts for 2 ranks"),
    ],
)
def test_a_bad_placement_or_path_is_refused_when_the_config_is_made(kwargs, what) -> None:
    with pytest.raises(ValueError, match=what):
        GroupConfig(**kwargs)


def test_good_placements_are_taken() -> None:
    cfg = GroupConfig(tp=2, rank_resources=[{"node_a": 1}, {"node_b": 0.5}], strategy="SPREAD")
    assert cfg.resources_of(1) == {"node_b": 0.5}
    assert GroupConfig(tp=1, use_gpus=False).use_gpus is False


def test_a_channel_group_without_its_channel_says_so() -> None:
    """A recovery that failed to rejoin the channel leaves no step path: ``paths()`` says
    ``none``, not ``ray`` (which only a ``transport="ray"`` group uses)."""
    ranks = RayRanks.__new__(RayRanks)  # the state alone: no Ray cluster needed
    ranks.world_size, ranks.path = 2, None
    ranks.transport = "channel"
    assert ranks.paths() == ["none", "none"]
    ranks.transport = "ray"
    assert ranks.paths() == ["ray", "ray"]


def test_a_group_ray_cannot_place_is_a_placement_error(ray_cluster) -> None:
    """A bundle the cluster cannot meet (a resource no node has) is refused at once with
    a typed error naming the resource (not after the start-up timeout: the cluster's
    resources are known), and nothing is left reserved."""
    import time

    from ray.util import placement_group_table

    from tpcache.coordinator.errors import PlacementError

    spec = GroupConfig(tp=1).worker_spec()
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"rank 0 asks for no_such_node=1, which no node"):
        RayRanks(spec, start_timeout_s=120.0, rank_resources=[{"no_such_node": 1}])
    assert time.monotonic() - t0 < 10
    after = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    assert after == before
