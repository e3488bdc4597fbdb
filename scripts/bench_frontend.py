"""The network frontend under load: calls/s of one client making unbatched calls against
N concurrent client processes, in one run, on a TP group of Ray ranks (step channel).

    .venv/bin/python scripts/bench_frontend.py [--tp 2] [--clients 8] [--seconds 10]
        [--rounds 3] [--batch K] [--json]

Each client loops over requests: admit (a 64-token prompt on one of a few shared
prefixes), extend by 4, finish; every call is one round trip (no client-side batching).
A round runs the single client, then the N clients, for ``--seconds`` each; the ratio is
taken per round and its median reported. With ``--batch K`` a round also runs the N
clients batched: each sends K requests' admits as one list (one message, one step), then
their K extends, then their K finishes, so 3K calls take 3 round trips; its ratio is
taken against the same unbatched single client, and counts calls, not messages. At the
end every rank's digest must equal the mirror's and nothing may be left held or locked.
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


def prompt_of(who: int, i: int) -> list[int]:
    return [1 + (i % 4), *range(100 + who, 163 + who)]


def batched_calls(c, who: int, i: int, k: int) -> None:
    """Requests ``i .. i+k-1`` of client ``who`` as three messages of k calls each."""
    rids = [f"c{who}-{j}" for j in range(i, i + k)]
    for make in (
        lambda b, j, rid: b.admit(rid, prompt_of(who, j)),
        lambda b, j, rid: b.extend(rid, 4),
        lambda b, j, rid: b.finish(rid, [7, 7, 7, 7]),
    ):
        with c.batch() as b:
            pending = [make(b, j, rid) for j, rid in zip(range(i, i + k), rids, strict=True)]
        for p in pending:
            p.result()  # raises the call's typed error, if it failed


def client_loop(endpoint: str, who: int, seconds: float, batch: int, ready, go, out) -> None:
    """One client process: once ``go`` is set, calls for ``seconds`` (``batch`` > 0: as
    lists of that many calls); puts (who, calls)."""
    from tpcache.client import NetworkClient

    with NetworkClient(endpoint) as c:
        c.stats()  # connected
        ready.put(who)
        go.wait()
        stop = time.time() + seconds
        calls = i = 0
        while time.time() < stop:
            if batch:
                batched_calls(c, who, i, batch)
                calls += 3 * batch
                i += batch
                continue
            rid = f"c{who}-{i}"
            c.admit(rid, prompt_of(who, i))
            c.extend(rid, 4)
            c.finish(rid, [7, 7, 7, 7])
            calls += 3
            i += 1
    out.put((who, calls))


def run_clients(endpoint: str, n: int, seconds: float, batch: int = 0) -> float:
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=client_loop, args=(endpoint, w, seconds, batch, ready, go, q))
        for w in range(n)
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


def batched_figures(k: int, batched: list[float], one: list[float]) -> dict:
    """The batched series against the unbatched single client, if it ran."""
    if not k:
        return {}
    ratios = [b / o for b, o in zip(batched, one, strict=True)]
    return {
        "batch": k,
        "batched_clients_calls_s": [round(x) for x in batched],
        "batched_ratio_median": round(statistics.median(ratios), 2),
        "batched_ratios": [round(r, 2) for r in ratios],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--batch", type=int, default=0, help="also run the N clients with K calls a message"
    )
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
    one, many, batched = [], [], []
    try:
        for _ in range(args.rounds):
            one.append(run_clients(front.endpoint, 1, args.seconds))
            many.append(run_clients(front.endpoint, args.clients, args.seconds))
            if args.batch:
                batched.append(run_clients(front.endpoint, args.clients, args.seconds, args.batch))
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
        **batched_figures(args.batch, batched, one),
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
