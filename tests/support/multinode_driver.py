"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``), one TP rank on each,
pinned by custom resources, the coordinator on the head: run by ``test_multinode.py`` in
a process of its own (a process can join one Ray cluster only). Prints one JSON line.

    python tests/support/multinode_driver.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import ray
from drill_worker import DrillWorker
from ray.cluster_utils import Cluster

from tpcache.coordinator.build import GroupConfig
from tpcache.frontend.service import connect, serve, start_group
from tpcache.harness.demo import run_demo, synthetic_chat
from tpcache.workers.protocol import DivergenceError
from tpcache.workers.spec import CacheSpec

FRONTEND = """
import json, sys, ray
from tpcache.frontend.service import connect
ray.init(address=sys.argv[1], namespace="mn", log_to_driver=False)
client = connect("mn-coord", "mn")
prompt = list(range(1, 80))
first = client.admit("fe-1", prompt)
client.finish("fe-1", [5, 6, 7])
second = client.admit("fe-2", prompt + [9])
client.finish("fe-2")
print(json.dumps({"first": first.prefix_len, "second": second.prefix_len,
                  "paths": client.stats()["rank_paths"]}))
"""


def config(**kw) -> GroupConfig:
    return GroupConfig(
        tp=2,
        capacity_tokens=16384,
        cache=CacheSpec(page_size=4, max_request_tokens=4096),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 22,
        timeout_s=20.0,
        strategy="SPREAD",
        rank_resources=[{"node_a": 1}, {"node_b": 1}],
        **kw,
    )


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="tpmn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 2},
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 2})
    out: dict = {}
    try:
        ray.init(address=cluster.address, namespace="mn", log_to_driver=False)
        here = ray.get_runtime_context().get_node_id()
        coord = start_group(config(), worker_cls=DrillWorker)
        try:
            out["rank_nodes_distinct"] = len(set(coord.ranks.rank_nodes)) == 2
            out["rank0_on_driver_node"] = coord.ranks.rank_nodes[0] == here
            out["paths"] = coord.ranks.paths()
            demo = run_demo(coord, synthetic_chat()[:120], batch=8)
            out["demo"] = {k: demo[k] for k in ("steps", "hit_rate", "lockstep_verified")}
            step = coord.stats()["steps_sent"]
            coord.ranks.call_on(1, "inject_fault", step, "corrupt")
            with coord.batch():  # rank 1 caches a tampered first token
                coord.admit("odd", list(range(1, 60)))
                coord.finish("odd")
            try:
                coord.sync()
                out["divergence"] = None
            except DivergenceError as exc:
                out["divergence"] = {"step": exc.step, "odd": list(exc.odd_ranks), "at": step}
            out["after_recovery"] = coord.stats()["recoveries"]
        finally:
            coord.close()
        actor = serve(config(), name="mn-coord", namespace="mn", resources={"node_a": 1})
        try:
            fe = subprocess.run(
                [sys.executable, "-c", FRONTEND, cluster.address],
                capture_output=True,
                text=True,
                timeout=180,
            )
            out["frontend"] = (
                json.loads(fe.stdout.strip().splitlines()[-1])
                if fe.returncode == 0
                else fe.stderr[-2000:]
            )
            out["served_digests_equal"] = len(set(ray.get(actor.rank_digests.remote()))) == 1
            connect("mn-coord", "mn").stats()
        finally:
            ray.get(actor.shutdown.remote())
            ray.kill(actor, no_restart=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
