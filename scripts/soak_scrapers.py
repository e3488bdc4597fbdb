"""Soak a served TP=2 group with Prometheus scrapers running flat-out beside the load.

A local Ray cluster of its own; the group is served as a named actor (as `tpcache serve`
does) with its metrics endpoint on; ``--clients`` threads drive it through Ray clients
(admit, decode steps, finish, some aborts, shared prefixes) while ``--scrapers`` threads
fetch /metrics as fast as it answers. A scrape reads the coordinator's stats on the
metrics server's thread, beside the steps. Prints the calls, the scrapes, and the
group's divergences, rank failures and recoveries, which must all be 0.

    .venv/bin/python scripts/soak_scrapers.py [--seconds 300] [--clients 4] [--scrapers 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request

import ray

from tpcache.frontend.service import GroupConfig, connect, serve, stop_served
from tpcache.workers.spec import CacheSpec


def load(client, seed: int, stop: threading.Event, calls: list[int]) -> None:
    """One client's traffic until ``stop``: prompts from a few shared stems, each
    decoded a few tokens, then finished (cached) or aborted."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 1000) for _ in range(rng.randrange(8, 200))] for _ in range(8)]
    i = 0
    while not stop.is_set():
        rid = f"{seed}-{i}"
        prompt = rng.choice(stems) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        client.admit(rid, prompt)
        out = []
        for _ in range(rng.randrange(1, 6)):
            client.extend(rid, 1)
            out.append(rng.randrange(1, 1000))
        if rng.random() < 0.2:
            client.abort(rid)
        else:
            client.finish(rid, out)
        calls[0] += 3 + len(out)
        i += 1


def scrape(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        urllib.request.urlopen(url, timeout=30).read()
        out.append(time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--scrapers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tpsk", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=16384,
        cache=CacheSpec(page_size=16, max_request_tokens=1024),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        cpu_budget_bytes=1 << 26,
        metrics_port=0,
    )
    name = f"soak-{os.getpid()}"
    actor = serve(cfg, name=name)
    try:
        client = connect(name)
        port = client.stats()["metrics_port"]
        url = f"http://127.0.0.1:{port}/metrics"
        stop = threading.Event()
        calls = [[0] for _ in range(args.clients)]
        scrapes: list[list[float]] = [[] for _ in range(args.scrapers)]
        threads = [
            threading.Thread(target=load, args=(connect(name), args.seed + k, stop, calls[k]))
            for k in range(args.clients)
        ] + [threading.Thread(target=scrape, args=(url, stop, s)) for s in scrapes]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        took = time.monotonic() - started
        client.sync()
        st = client.stats()
    finally:
        stop_served(actor, name, "tpcache")
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    every = [s for one in scrapes for s in one]
    print(f"machine: {platform.node()} ({os.cpu_count()} cpus), {platform.processor() or ''}")
    print(f"seconds: {took:.0f}, clients {args.clients}, scrapers {args.scrapers}")
    print(f"calls: {sum(c[0] for c in calls):,}, steps done {st['steps_done']:,}")
    print(
        f"scrapes: {len(every):,} (median {statistics.median(every) * 1e3:.1f} ms, "
        f"max {max(every) * 1e3:.0f} ms)"
        if every
        else "scrapes: 0"
    )
    print(
        f"divergences: {st['divergences']}, rank failures: {st['rank_failures']}, "
        f"recoveries: {st['recoveries']}"
    )
    bad = st["divergences"] + st["rank_failures"] + st["recoveries"]
    raise SystemExit(1 if bad or not every else 0)


if __name__ == "__main__":
    main()
