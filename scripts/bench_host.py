"""Copy throughput of one rank's host tier (``kv/host_copy.py``): device pool to host
pool and back, in pages of ``--page`` slots, through the copy engine's thread, against a
bare ``torch`` copy of the same bytes (one ``index_select`` + ``index_copy_`` per layer,
the floor of what the engine does). On CUDA the device pool is on the GPU and the host
pool pinned, and the bare figure is the measured device-to-host / host-to-device
bandwidth; here it is a CPU-to-CPU copy.

``--lockstep N``: also what agreeing copy completion costs a TP group
(``workers/copysync.py``): N admit/finish rounds through TP=2 rank threads over a real
gloo group (``start_local_group``), with a host tier and without one at the same device
capacity. Each round admits a request over shared 512-token prefixes that overflow the
device pool, waits until it may run its forward (``wait_ready``, as an engine does: where
a copy's latency and the agreement's rounds show), and finishes it.

    .venv/bin/python scripts/bench_host.py [--slots 65536] [--page 16] [--pages 512]
        [--rounds 5] [--lockstep 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import numpy as np
import torch

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.kv.host_copy import TO_DEVICE, TO_HOST, CopyEngine, CopyJob, host_pool
from tpcache.kv.pool import KVPool, PoolSpec
from tpcache.workers.spec import CacheSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=1 << 16)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--pages", type=int, default=512, help="pages per copy job")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lockstep", type=int, default=0, help="admit/finish rounds at TP=2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spec = PoolSpec(args.layers, args.heads, args.head_dim, 1, "bfloat16")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = KVPool(spec, args.slots, device)
    host = host_pool(dev, args.slots)
    eng = CopyEngine(dev, host)
    rng = np.random.default_rng(0)
    n = args.pages * args.page
    nbytes = n * spec.bytes_per_slot
    engine_s: dict[str, list[float]] = {TO_HOST: [], TO_DEVICE: []}
    bare_s: dict[str, list[float]] = {TO_HOST: [], TO_DEVICE: []}
    job = 0
    for _ in range(args.rounds):
        pages = rng.choice(args.slots // args.page, size=args.pages, replace=False)
        slots = (pages[:, None] * args.page + np.arange(args.page)).ravel()
        for kind in (TO_HOST, TO_DEVICE):
            t = time.perf_counter()
            eng.submit(CopyJob(job, kind, slots, slots))
            job += 1
            eng.wait(job, 600.0)
            engine_s[kind].append(time.perf_counter() - t)
            src, dst = (dev, host) if kind == TO_HOST else (host, dev)
            idx_s = torch.as_tensor(slots, device=src.device)
            idx_d = torch.as_tensor(slots, device=dst.device)
            t = time.perf_counter()
            for layer in range(spec.num_layers):
                for s_buf, d_buf in zip(
                    src.layer_buffers(layer), dst.layer_buffers(layer), strict=True
                ):
                    d_buf.index_copy_(0, idx_d, s_buf.index_select(0, idx_s).to(d_buf.device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            bare_s[kind].append(time.perf_counter() - t)
    eng.close()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in engine_s.items()}
    bare = {k: nbytes / statistics.median(v) / 1e9 for k, v in bare_s.items()}
    out = {
        "machine": f"{platform.node()}: {os.cpu_count()} cpus, device {device}",
        "bytes_per_job": nbytes,
        "engine_GBps": {k: round(v, 3) for k, v in gbps.items()},
        "bare_torch_GBps": {k: round(v, 3) for k, v in bare.items()},
        "engine_over_bare": {k: round(gbps[k] / bare[k], 2) for k in gbps},
    }
    if args.lockstep:
        device_only = lockstep_run(None, args.lockstep, 0)
        tiered = lockstep_run(1 << 16, args.lockstep, 0)
        out["lockstep_device_only"] = device_only
        out["lockstep_host_tier"] = tiered
        out["lockstep_calls_ratio"] = round(tiered["calls_per_s"] / device_only["calls_per_s"], 2)
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>18}: {v}")


def lockstep_run(host: int | None, requests: int, seed: int) -> dict:
    """One TP=2 group of rank threads (``--lockstep``): admit, wait_ready, finish."""
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
        counts = coord.mirror.host.counts() if coord.mirror.host is not None else {}
        return {
            "calls_per_s": round(2 * requests / elapsed, 1),
            "wait_ready_ms_mean": round(waited / requests * 1e3, 3),
            "extra_steps_per_request": round(steps_behind / requests, 2),
            "steps": coord.steps.steps_sent,
            "copies": counts.get("copies_started", 0),
        }
    finally:
        coord.close()


if __name__ == "__main__":
    main()
