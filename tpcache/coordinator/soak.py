"""A soak of one TP group: many mixed calls under eviction pressure, with aborts and
chunked prefill, checking at the end that nothing leaked and memory stayed flat."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from tpcache.cache.errors import InvalidTokens, OutOfCapacity
from tpcache.coordinator.core import Coordinator


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process on this machine (Linux /proc), in MB."""
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_soak(coord: Coordinator, calls: int, seed: int = 0, batch: int = 8) -> dict[str, Any]:
    """Drive ``coord`` with about ``calls`` calls; returns the figures. Raises on any
    divergence or rank failure (the coordinator checks every step)."""
    rng = random.Random(seed)
    limit = coord.mirror.config.request_limit
    stem_max = max(17, min(400, limit // 2))
    stems = [
        [rng.randrange(1, 30_000) for _ in range(rng.randrange(16, stem_max))] for _ in range(24)
    ]
    running: dict[int, list[int]] = {}
    nxt = done = aborted = chunked = rejected = 0
    pids = coord.ranks.call("pid")
    rss_start: list[float] = []
    t0 = time.perf_counter()
    warm = max(1, calls // 5)
    made = 0
    while made < calls:
        with coord.batch():
            for _ in range(batch):
                made += 1
                r = rng.random()
                if r < 0.4 or not running:
                    prompt = rng.choice(stems) + [
                        rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 200))
                    ]
                    try:
                        coord.admit(nxt, prompt)
                        running[nxt] = prompt
                    except OutOfCapacity:
                        rejected += 1
                    nxt += 1
                    continue
                rid = rng.choice(list(running))
                if r < 0.75:
                    n = rng.randrange(1, 64)
                    try:
                        coord.extend(rid, n)
                    except (OutOfCapacity, InvalidTokens):  # full, or past the request limit
                        rejected += 1
                        n = 0
                    coord.finish(rid, [rng.randrange(1, 30_000) for _ in range(n)])
                    done += 1
                    del running[rid]
                elif r < 0.85:
                    coord.abort(rid)
                    aborted += 1
                    del running[rid]
                else:
                    more = [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 64))]
                    try:
                        coord.extend(rid, len(more))
                    except (OutOfCapacity, InvalidTokens):
                        rejected += 1
                        continue
                    running[rid] = running[rid] + more
                    coord.cache_unfinished(rid, running[rid])
                    chunked += 1
        if made >= warm and not rss_start:
            coord.sync()
            rss_start = [rss_mb()] + [rss_mb(p) for p in pids]
    with coord.batch():
        for rid in list(running):
            coord.finish(rid)
    coord.sync()
    elapsed = time.perf_counter() - t0
    infos = coord.ranks.call("info")
    coord.ranks.call("check_integrity")
    coord.mirror.check_integrity()
    cap = coord.mirror.sizes().capacity
    stats = coord.stats()
    return {
        "calls": made,
        "steps": stats["steps_done"],
        "steps_per_s": stats["steps_done"] / elapsed,
        "elapsed_s": elapsed,
        "admitted": nxt - rejected,
        "finished": done,
        "aborted": aborted,
        "chunked_prefill_calls": chunked,
        "rejected_out_of_capacity": rejected,
        "evicted_tokens": stats["evicted_tokens"],
        "hit_rate": stats["hit_rate"],
        "divergences": stats["divergences"],
        "no_leak": all(
            i["free"] + i["evictable"] == cap and i["held"] == 0 and i["protected"] == 0
            for i in infos
        ),
        "rank_digests_equal": len({i["digest"] for i in infos}) == 1
        and infos[0]["digest"] == coord.mirror.digest(),
        "rss_mb_after_warmup": [round(x, 1) for x in rss_start],
        "rss_mb_end": [round(rss_mb(), 1)] + [round(rss_mb(p), 1) for p in pids],
    }
