"""``--rank-resources`` the cluster cannot meet is refused at once, naming the resource
and what the nodes have; Ray itself waits out the start-up timeout (130 s from the
command line) before its PlacementError. Checked against a real local Ray cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tpcache.coordinator.cluster import check_placeable, placement_problem
from tpcache.coordinator.errors import PlacementError


def test_a_resource_no_node_has_stops_the_command_at_once() -> None:
    """The command as a user runs it: a cluster of its own (``--address local``)."""
    tmp = tempfile.mkdtemp(prefix="tpp", dir="/tmp")  # Ray's socket paths stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = tmp
    try:
        t0 = time.monotonic()
        demo = ["demo", "--tp", "2", "--limit", "4", "--rank-resources", "node_z=1"]
        got = subprocess.run(
            [sys.executable, "-m", "tpcache", *demo, "--address", "local"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        took = time.monotonic() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert "Traceback" not in got.stderr, got.stderr
    ours = [ln for ln in got.stderr.splitlines() if ln.startswith("tpcache demo: ")]
    assert got.returncode == 1 and len(ours) == 1, got.stderr
    assert ours[0].startswith(
        "tpcache demo: the group did not start: PlacementError: cannot place the ranks: "
        "rank 0 asks for node_z=1, which no node of the cluster has; the nodes have "
    )
    assert "CPU=" in ours[0] and "memory" not in ours[0]  # Ray's own entries left out
    assert took < 60, took  # Ray's wait would be 120 s more


def test_what_no_node_or_no_cluster_can_hold(ray_cluster) -> None:
    """Against the session cluster's own nodes (one node, 4 CPUs)."""
    import ray

    nodes = ray.nodes()
    assert placement_problem([{"CPU": 1}, {"CPU": 2}], nodes) is None
    too_big = placement_problem([{"CPU": 0.01}, {"CPU": 64}], nodes)
    assert too_big is not None and too_big.startswith("rank 1's CPU=64 fits on no one node")
    together = placement_problem([{"CPU": 3}, {"CPU": 3}], nodes)
    assert together is not None
    assert together.startswith("the 2 ranks ask for CPU=6 in all, the cluster has CPU=4")
    with pytest.raises(PlacementError, match="rank 1 asks for ssd=1, which no node"):
        check_placeable([{"CPU": 0.01}, {"CPU": 0.01, "ssd": 1}])


def test_dead_nodes_hold_nothing() -> None:
    node = {"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"node_a": 1.0}}
    said = placement_problem([{"node_a": 1}], [node])
    assert (
        said
        == "rank 0 asks for node_a=1, which no node of the cluster has; the cluster has no alive node"
    )
