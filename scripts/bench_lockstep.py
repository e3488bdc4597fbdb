"""Lockstep cost: per-step latency and steps/s at TP=2 and TP=4 on CPU ranks, for
batches of 1, 8 and 64 requests (admit + finish each), unpipelined and pipelined,
against the floor measured in the same run: one bare Ray round trip to every rank that
does one bare all-reduce (what a step cannot avoid).

    .venv/bin/python scripts/bench_lockstep.py [--tp 2 4] [--steps 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import ray

from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.service import GroupConfig, start_group
from tpcache.workers.rank import CacheSpec


def floor_ms(coord, n: int) -> float:
    actors = coord.ranks.actors
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        ray.get([a.collective_ping.remote() for a in actors])
        samples.append(time.perf_counter() - t)
    return statistics.median(samples[n // 10 :]) * 1e3


def run_steps(coord, batch: int, steps: int, pipelined: bool, seed: int) -> tuple[float, float]:
    """(median per-step latency ms, steps/s). Unpipelined waits for each step's results."""
    coord.config = CoordinatorConfig(max_inflight=4 if pipelined else 1)
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 30_000, size=48, dtype=np.int32)
    lat = []
    rid = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        with coord.batch():
            for _ in range(batch):
                tail = rng.integers(1, 30_000, size=16, dtype=np.int32)
                coord.admit(rid, np.concatenate((shared, tail)))
                coord.finish(rid, tail[:4])
                rid += 1
        if not pipelined:
            coord.sync()
        lat.append(time.perf_counter() - t)
    coord.sync()
    elapsed = time.perf_counter() - t0
    return statistics.median(lat) * 1e3, steps / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tpb", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    rows = []
    for tp in args.tp:
        cfg = GroupConfig(
            tp=tp,
            capacity_tokens=1 << 18,
            cache=CacheSpec(page_size=16),
            kv_heads=tp,
            num_layers=1,
            head_dim=4,
            cpu_budget_bytes=1 << 26,
        )
        coord = start_group(cfg)
        try:
            run_steps(coord, 8, 10, True, 0)  # warm-up
            floor = floor_ms(coord, 200)
            for batch in (1, 8, 64):
                lat, sps_unpiped = run_steps(coord, batch, args.steps, False, batch)
                _, sps_piped = run_steps(coord, batch, args.steps, True, batch + 1)
                rows.append(
                    {
                        "tp": tp,
                        "batch": batch,
                        "floor_ms": round(floor, 3),
                        "step_ms_unpipelined": round(lat, 3),
                        "overhead_vs_floor": round(lat / floor, 2),
                        "steps_s_unpipelined": round(sps_unpiped, 1),
                        "steps_s_pipelined": round(sps_piped, 1),
                        "pipelining_gain": round(sps_piped / sps_unpiped, 2),
                    }
                )
                coord.reset()
                coord.sync()
        finally:
            coord.close()
    machine = f"{platform.node()} ({os.cpu_count()} cpus, {platform.machine()})"
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}))
        return
    print(f"lockstep benchmark on {machine}; {args.steps} steps per cell, medians")
    print(
        f"{'tp':>3} {'batch':>5} {'floor ms':>9} {'step ms':>8} {'x floor':>8} {'steps/s':>8} {'piped/s':>8} {'gain':>5}"
    )
    for r in rows:
        print(
            f"{r['tp']:>3} {r['batch']:>5} {r['floor_ms']:>9.3f} {r['step_ms_unpipelined']:>8.3f} "
            f"{r['overhead_vs_floor']:>8.2f} {r['steps_s_unpipelined']:>8.1f} {r['steps_s_pipelined']:>8.1f} "
            f"{r['pipelining_gain']:>5.2f}"
        )


if __name__ == "__main__":
    main()
