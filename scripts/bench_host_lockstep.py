"""What agreeing copy completion costs a TP group (``workers/copysync.py``): the same
admit/finish workload through TP=2 rank threads over a real gloo group
(``start_local_group``), with a host tier and without one, at the same device capacity,
and how far the agreed completion trails the copies (in steps).

Each round admits a request, waits until it may run its forward (``wait_ready``, as an
engine does before a forward: this is where a copy's latency shows), and finishes it.
The prompts overflow the device pool, so most admits write back or load.

    .venv/bin/python scripts/bench_host_lockstep.py [--requests 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.workers.spec import CacheSpec


def run(host: int | None, requests: int, seed: int) -> dict:
    cache = CacheSpec(page_size=16, max_request_tokens=4096, host_capacity_tokens=host)
    cfg = GroupConfig(tp=2, capacity_tokens=4096, cache=cache, num_layers=2, kv_heads=4,
                      head_dim=64, dtype="float16", cpu_budget_bytes=1 << 28)  # fmt: skip
    coord = start_local_group(cfg)
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 30000) for _ in range(512)] for _ in range(24)]
    waited = steps_behind = 0.0
    try:
        started = time.perf_counter()
        for i in range(requests):
            prompt = rng.choice(heads) + [rng.randrange(1, 30000) for _ in range(32)]
            coord.admit(i, prompt)
            t = time.perf_counter()
            sent = coord.steps.steps_sent
            coord.wait_ready([i], 60.0)
            waited += time.perf_counter() - t
            steps_behind += coord.steps.steps_sent - sent
            coord.finish(i)
        coord.sync()
        elapsed = time.perf_counter() - started
        counts = coord.mirror.host_counts() if host else {}
        return {
            "calls_per_s": round(2 * requests / elapsed, 1),
            "wait_ready_ms_mean": round(waited / requests * 1e3, 3),
            "extra_steps_per_request": round(steps_behind / requests, 2),
            "steps": coord.steps.steps_sent,
            "copies": counts.get("copies_started", 0),
        }
    finally:
        coord.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)
    out = {
        "machine": f"{platform.node()}: {os.cpu_count()} cpus",
        "device_only": run(None, args.requests, args.seed),
        "host_tier": run(1 << 16, args.requests, args.seed),
    }
    out["calls_per_s_ratio"] = round(
        out["host_tier"]["calls_per_s"] / out["device_only"]["calls_per_s"], 2
    )
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
