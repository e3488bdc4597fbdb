"""Copy throughput of one rank's host tier (``workers/hostcopy.py``): device pool to host
pool and back, in pages of ``--page`` slots, through the copy engine's thread, against a
bare ``torch`` copy of the same bytes (one ``index_select`` + ``index_copy_`` per layer,
the floor of what the engine does). On CUDA the device pool is on the GPU and the host
pool pinned, and the bare figure is the measured device-to-host / host-to-device
bandwidth; here it is a CPU-to-CPU copy.

    .venv/bin/python scripts/bench_host.py [--slots 65536] [--page 16] [--pages 512]
        [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from tpcache.workers.hostcopy import TO_DEVICE, TO_HOST, CopyEngine, CopyJob, host_pool
from tpcache.workers.kvpool import KVPool, PoolSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=1 << 16)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--pages", type=int, default=512, help="pages per copy job")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
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
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
