"""A soak of one TP group: many mixed calls under eviction pressure, with aborts, chunked
prefill and explicit evictions, checking at the end that nothing leaked and memory
stayed flat."""

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


class _Workload:
    """The calls of a soak, drawn from one seeded generator. Requests live across calls:
    they grow by decode steps and prefill chunks before they finish or are aborted, so
    both pools fill with running requests while the cache is under eviction."""

    def __init__(self, coord: Coordinator, seed: int) -> None:
        self.coord = coord
        self.rng = rng = random.Random(seed)
        self.limit = coord.mirror.config.request_limit
        self.stem_max = max(17, self.limit // 2)
        self.hybrid = len(coord.mirror.evictable_pages()) > 1
        self.stems = [self.fresh(rng.randrange(16, self.stem_max)) for _ in range(24)]
        # Request id -> [tokens given to the cache so far, slots held].
        self.running: dict[int, list[Any]] = {}
        self.next_rid = 0
        self.counts = dict.fromkeys(
            ("admitted", "finished", "aborted", "chunked", "evicts", "rejected"), 0
        )

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 30_000) for _ in range(n)]

    def one_call(self) -> None:
        r = self.rng.random()
        if r < 0.35 or not self.running:
            self.admit()
        elif r < 0.93:
            rid = self.rng.choice(list(self.running))
            if r < 0.58:
                self.extend(rid, self.rng.randrange(1, 64))
            elif r < 0.75:
                self.finish(rid)
            elif r < 0.82:
                self.coord.abort(rid)
                del self.running[rid]
                self.counts["aborted"] += 1
            else:
                self.chunk(rid)
        else:
            self.evict()

    def admit(self) -> None:
        prompt = self.rng.choice(self.stems) + self.fresh(self.rng.randrange(1, self.stem_max))
        try:
            got = self.coord.admit(self.next_rid, prompt)
            self.running[self.next_rid] = [prompt, got.num_tokens]
            self.counts["admitted"] += 1
        except OutOfCapacity:
            self.counts["rejected"] += 1
        self.next_rid += 1

    def extend(self, rid: int, n: int) -> bool:
        try:
            self.coord.extend(rid, n)
        except (OutOfCapacity, InvalidTokens):  # full, or past the request limit
            self.counts["rejected"] += 1
            return False
        self.running[rid][1] += n
        return True

    def finish(self, rid: int) -> None:
        tokens, held = self.running.pop(rid)
        # Output up to a few tokens past what holds KV (those are not cached).
        out = self.fresh(max(0, held - len(tokens)) + self.rng.randrange(0, 4))
        self.coord.finish(rid, out)
        self.counts["finished"] += 1

    def chunk(self, rid: int) -> None:
        more = self.fresh(self.rng.randrange(1, 64))
        tokens, held = self.running[rid]
        if held - len(tokens) < len(more) and not self.extend(rid, len(more)):
            return
        self.running[rid][0] = tokens + more
        self.coord.cache_unfinished(rid, self.running[rid][0])
        self.counts["chunked"] += 1

    def evict(self) -> None:
        rng = self.rng
        full = rng.randrange(1, 96) if not self.hybrid or rng.random() < 0.3 else 0
        self.coord.evict(full, rng.randrange(1, 96) if self.hybrid else 0)
        self.counts["evicts"] += 1


def run_soak(coord: Coordinator, calls: int, seed: int = 0, batch: int = 8) -> dict[str, Any]:
    """Drive ``coord`` with about ``calls`` calls, ``batch`` per step; returns the figures.
    Raises on any divergence or rank failure (the coordinator checks every step).

    Calls: admit (a shared stem and a fresh tail, up to the request limit), extend
    (decode), finish, abort, extend + cache_unfinished (chunked prefill), and explicit
    evictions (SWA ones too with a hybrid cache, where they make tombstones)."""
    work = _Workload(coord, seed)
    pids = coord.ranks.call("pid")
    rss_start: list[float] = []
    t0 = time.perf_counter()
    warm = max(1, calls // 5)
    made = 0
    while made < calls:
        with coord.batch():
            for _ in range(batch):
                made += 1
                work.one_call()
        if made >= warm and not rss_start:
            coord.sync()
            rss_start = [rss_mb()] + [rss_mb(p) for p in pids]
    with coord.batch():
        for rid in list(work.running):
            work.finish(rid)
    coord.sync()
    elapsed = time.perf_counter() - t0
    infos = coord.ranks.call("info")
    coord.ranks.call("check_integrity")
    coord.mirror.check_integrity()
    stats = coord.stats()
    c = work.counts
    return {
        "calls": made,
        "steps": stats["steps_done"],
        "steps_per_s": stats["steps_done"] / elapsed,
        "elapsed_s": elapsed,
        "admitted": c["admitted"],
        "finished": c["finished"],
        "aborted": c["aborted"],
        "chunked_prefill_calls": c["chunked"],
        "evict_calls": c["evicts"],
        "rejected_out_of_capacity": c["rejected"],
        "evicted_tokens": stats["evicted_tokens"],
        "hit_rate": stats["hit_rate"],
        "divergences": stats["divergences"],
        # Every pool of every rank: all free or cached, nothing held or locked.
        "no_leak": all(
            free + evictable == capacity and held == 0 and protected == 0
            for i in infos
            for capacity, free, evictable, protected, held in i["pools"]
        ),
        "rank_digests_equal": len({i["digest"] for i in infos}) == 1
        and infos[0]["digest"] == coord.mirror.digest(),
        "rss_mb_after_warmup": [round(x, 1) for x in rss_start],
        "rss_mb_end": [round(rss_mb(), 1)] + [round(rss_mb(p), 1) for p in pids],
    }
