"""Soak a TP group on CPU: many thousands of mixed calls, eviction pressure, aborts and
chunked prefill. Prints calls, steps, steps/s, evictions, and RSS (coordinator, ranks)
after warm-up and at the end.

    .venv/bin/python scripts/soak.py [--tp 2] [--calls 20000] [--capacity 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import ray

from tpcache.frontend.service import GroupConfig, start_group
from tpcache.harness.soak import run_soak
from tpcache.workers.rank import CacheSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tps", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    cfg = GroupConfig(
        tp=args.tp,
        capacity_tokens=args.capacity,
        cache=CacheSpec(page_size=args.page_size, max_request_tokens=args.capacity // 4),
        num_layers=1,
        kv_heads=args.tp,
        head_dim=4,
        cpu_budget_bytes=1 << 28,
    )
    coord = start_group(cfg)
    try:
        out = run_soak(coord, args.calls, args.seed)
    finally:
        coord.close()
    out["machine"] = f"{platform.node()} ({os.cpu_count()} cpus)"
    out["seed"] = args.seed
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>26}: {v}")


if __name__ == "__main__":
    main()
