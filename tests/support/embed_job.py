"""A torchrun job that owns ``torch.distributed`` and embeds tpcache's rank side in it.

    torchrun --standalone --nproc_per_node=2 tests/support/embed_job.py [seed]

The job initialises its own world first (as an engine does), runs a collective of its
own, makes a TP group with ``dist.new_group`` and hands it to tpcache
(``TPGroup.attach`` + ``RankWorker.attach_and_setup``): each rank's pool sized by the
Llama-style runner's layout (capacity agreed by MIN over that group), rank 0 the
coordinator (``TorchrunRanks``: steps and calls broadcast over the group), the others
following. Rank 0 runs batched forwards through the cache against full recompute. Then
the job's world and its group still work, and tpcache's shutdown left them alone. Rank 0
prints one line, ``{"tpcache_embed": {...}}``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcache.engine.forward import ModelEngine
from tpcache.group.spec import GroupError
from tpcache.group.tp_group import TPGroup
from tpcache.harness.modelcheck import Workload, run_workload
from tpcache.model.llama import LlamaReference, LlamaSpec
from tpcache.model.runner_spec import RunnerSpec, runner_pool
from tpcache.torchrun import TorchrunRanks, coordinator
from tpcache.workers.lead import follow
from tpcache.workers.rank import RankWorker
from tpcache.workers.spec import CacheSpec, WorkerSpec

LLAMA = "tpcache.model.llama:LlamaRunner"
ARGS = {"heads": 8, "kv_heads": 2, "hidden": 48, "ffn": 96, "vocab": 64}


def job_sum(group=None) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=group)
    return float(t)


def lead(worker: RankWorker, capacity: int, cache: CacheSpec, seed: int) -> dict:
    """Rank 0: batched forwards through the cache, checked against full recompute."""
    coord = coordinator(worker, capacity, cache)
    ranks: TorchrunRanks = coord.ranks  # type: ignore[assignment]
    try:
        eng = ModelEngine(coord)
        ref = LlamaReference(LlamaSpec.from_args(seed=seed, **ARGS))
        wl = Workload(seed=seed, requests=6, chunk=5, concurrency=3)
        rep = run_workload(eng, ref, wl, tol=1e-5)
        coord.sync()
        return {
            "report": rep.as_dict(),
            "ok": rep.ok(1e-5),
            "digests_equal": ranks.call("digest") == [coord.mirror.digest()] * ranks.world_size,
            "tokens_computed": [i["tokens_computed"] for i in ranks.call("info")],
            "backends": [i["backend"] for i in ranks.call("info")],
        }
    finally:
        ranks.close()  # Stop: the followers leave their loop


def main(seed: int) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the job's own world
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"job_sum_before": job_sum()}
    tp_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=60))
    runner = RunnerSpec.of(LLAMA, {"seed": seed, **ARGS})
    cache = CacheSpec(page_size=4, max_request_tokens=64)
    spec = WorkerSpec(
        pool=runner_pool(runner, world, None),
        cache=cache,
        capacity_tokens=160 + 32 * rank,  # ranks offer different budgets: MIN is agreed
        cpu_budget_bytes=1 << 24,
        runner=runner,
    )
    worker = RankWorker(rank, spec, int(os.environ.get("LOCAL_RANK", "0")))
    try:  # joining a group of its own is refused: the job already has one
        worker.join("127.0.0.1", 29999)
        out["join_refused"] = False
    except GroupError as exc:
        out["join_refused"] = "TPGroup.attach" in str(exc)
    group = TPGroup.attach(tp_group, timeout_s=60.0, where="job")
    capacity = worker.attach_and_setup(group)
    out["capacity"] = capacity
    if rank == 0:
        out.update(lead(worker, capacity, cache, seed))
    else:
        follow(group, worker, rank, world)
    worker.shutdown()  # leaves the job's group to the job
    out["job_sum_after"] = job_sum()
    out["tp_group_sum_after"] = job_sum(tp_group)
    if rank == 0:
        print(json.dumps({"tpcache_embed": out}), flush=True)
    dist.destroy_process_group()
    return 0 if rank or out.get("ok") else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
