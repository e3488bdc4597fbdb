"""The network frontend under load: calls/s of one client making unbatched calls against
N concurrent client processes, in one run, on a TP group of Ray ranks (step channel).

    .venv/bin/python scripts/bench_frontend.py [--tp 2] [--clients 8] [--seconds 10]
        [--rounds 3] [--json]

Each client loops over requests: admit (a 64-token prompt on one of a few shared
prefixes), extend by 4, finish; every call is one round trip (no client-side batching).
A round runs the single client, then the N clients, for ``--seconds`` each; the ratio is
taken per round and its median reported. At the end every rank's digest must equal the
mirror's and nothing may be left held or locked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import threading
import time

import ray

from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import GroupConfig, start_group
from tpcache.workers.spec import CacheSpec


def client_loop(endpoint: str, who: int, seconds: float, ready, go, out) -> None:
    """One client process: once ``go`` is set, calls for ``seconds``; puts (who, calls)."""
    from tpcache.client import Client

    with Client(endpoint) as c:
        c.stats()  # connected
        ready.put(who)
        go.wait()
        stop = time.time() + seconds
        calls = i = 0
        while time.time() < stop:
            rid = f"c{who}-{i}"
            prompt = [1 + (i % 4), *range(100 + who, 163 + who)]
            c.admit(rid, prompt)
            c.extend(rid, 4)
            c.finish(rid, [7, 7, 7, 7])
            calls += 3
            i += 1
    out.put((who, calls))


def run_clients(endpoint: str, n: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=client_loop, args=(endpoint, w, seconds, ready, go, q)) for w in range(n)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every client started and connected: start them together
        ready.get(timeout=300)
    go.set()
    total = sum(q.get(timeout=seconds + 120)[1] for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tpf", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    cfg = GroupConfig(
        tp=args.tp,
        capacity_tokens=1 << 16,
        cache=CacheSpec(page_size=16),
        kv_heads=args.tp,
        num_layers=1,
        head_dim=4,
        cpu_budget_bytes=1 << 26,
    )
    coord = start_group(cfg)
    lock = threading.Lock()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), lock)
    one, many = [], []
    try:
        for _ in range(args.rounds):
            one.append(run_clients(front.endpoint, 1, args.seconds))
            many.append(run_clients(front.endpoint, args.clients, args.seconds))
        with lock:
            coord.sync()
            digests = coord.ranks.call("digest")
            s = coord.mirror.sizes()
            ok = set(digests) == {coord.mirror.digest()} and s.held == 0 and s.protected == 0
            steps = coord.stats()["steps_done"]
    finally:
        front.close()
        coord.close()
    ratios = [m / o for m, o in zip(many, one, strict=True)]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    out = {
        "machine": f"{platform.node()}: {os.cpu_count()} cpus, load avg {load}",
        "tp": args.tp,
        "clients": args.clients,
        "one_client_calls_s": [round(x) for x in one],
        "many_clients_calls_s": [round(x) for x in many],
        "ratio_median": round(statistics.median(ratios), 2),
        "ratios": [round(r, 2) for r in ratios],
        "frontend_steps": front.steps,
        "steps_done": steps,
        "digests_equal_nothing_leaked": ok,
    }
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>30}: {v}")


if __name__ == "__main__":
    main()
