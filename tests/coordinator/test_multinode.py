"""Ranks across nodes: a Ray cluster of two nodes on one machine, one rank per node
(custom resources and SPREAD), the coordinator on the head. The lockstep demo verifies
on it, a planted divergence on the remote rank is caught at its step and named, and a
frontend in a separate process drives a served coordinator. The step channel reaches the
rank on the coordinator's node over IPC and the other over CURVE TCP.

The cluster runs in a process of its own (``multinode_driver.py``): a process joins one
Ray cluster only, and the suite's session cluster is another.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_two_nodes_one_rank_each() -> None:
    driver = Path(__file__).resolve().parents[1] / "support" / "multinode_driver.py"
    run = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(out)
    assert out["rank_nodes_distinct"] and out["rank0_on_driver_node"]
    assert out["paths"] == ["ipc", "tcp+curve"]
    assert out["demo"]["lockstep_verified"] and out["demo"]["steps"] > 10
    assert out["divergence"]["odd"] == [1] and out["divergence"]["step"] == out["divergence"]["at"]
    assert out["after_recovery"] == 1
    assert out["frontend"] == {"first": 0, "second": 76, "paths": ["ipc", "tcp+curve"]}
    assert out["served_digests_equal"]
