"""Cache state machine speed and memory: the conversation trace replayed through the
cache alone (``tpcache.replay``), and the time of one ``match_prefix`` of a cached
32k-token prompt given as a numpy int32 array.

    .venv/bin/python scripts/bench_cache.py [--limit N] [--repeat K] [--json]

Each replay row runs in a fresh subprocess, so its peak RSS is its own. ``cache_ops_s``
is wall time of the cache calls (as ``tpcache replay`` reports it); ``cpu_s`` is the
CPU time (of the main thread) of the same replay minus that of synthesising its tokens alone, a
figure that noise from other processes on a shared machine moves less. With
``--repeat K`` the rows run in K rounds (each row once per round) and the median run
of each row is shown; a ratio between rows is the median of the per-round ratios. Figures are
printed with their ratio to the targets set for the cache (0.8 s for the whole trace at 3M
tokens, 20 us per 32k match, 1.5 GB peak RSS at infinite capacity): ratios, not
verdicts.

To add a row (e.g. the hybrid SWA cache), append to ``ROWS``: ``options`` are passed to
``tpcache.replay.ReplayOptions`` as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from tpcache.trace import DEFAULT_TRACE as TRACE

# name -> ReplayOptions keyword arguments. "target_s" is the target for cache_ops_s.
ROWS: list[dict] = [
    {"name": "radix 3M", "options": {"capacity": 3_000_000, "page_size": 16}, "target_s": 0.8},
    {"name": "radix inf", "options": {"capacity": None, "page_size": 16}, "target_rss_mb": 1536},
    # The hybrid (full + SWA) cache at the same full capacity; its target is 1.5x the
    # "vs" row's cache ops time.
    {
        "name": "hybrid 3M/1M w4k",
        "options": {
            "capacity": 3_000_000,
            "page_size": 16,
            "swa_window": 4096,
            "swa_capacity": 1_000_000,
        },
        "vs": "radix 3M",
        "target_x": 1.5,
    },
    {
        "name": "hybrid 3M/3M w4k",
        "options": {"capacity": 3_000_000, "page_size": 16, "swa_window": 4096},
        "vs": "radix 3M",
        "target_x": 1.5,
    },
]
MATCH_TARGET_US = 20.0


def run_row(index: int, trace: str, limit: int | None) -> dict:
    """One replay row, in this process (called in the child)."""
    from tpcache.replay import ReplayOptions, replay
    from tpcache.trace import load_trace, output_tokens, prompt_tokens

    row = ROWS[index]
    requests = load_trace(trace, limit)
    checks = _time_integrity_checks()
    c0 = time.thread_time()
    summary = replay(requests, ReplayOptions(**row["options"]))
    c1 = time.thread_time()
    for req in requests:  # what replay spent on synthesising tokens, not on the cache
        prompt_tokens(req)
        output_tokens(req)
    c2 = time.thread_time()
    summary["cpu_s"] = round((c1 - c0) - (c2 - c1) - checks[0], 3)
    summary["integrity_check_cpu_s"] = round(checks[0], 3)
    summary["name"] = row["name"]
    return summary


def _time_integrity_checks() -> list[float]:
    """Count the CPU time of the full check_integrity() walk replay() ends with, so that
    cpu_s is the cache ops alone."""
    import importlib

    spent = [0.0]
    for module, name in (
        ("tpcache.cache.radix", "RadixCache"),
        ("tpcache.cache.swa.cache", "HybridCache"),
    ):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        original = cls.check_integrity

        def timed(self, _original=original) -> None:
            t = time.thread_time()
            try:
                _original(self)
            finally:
                spent[0] += time.thread_time() - t

        cls.check_integrity = timed
    return spent


def run_row_fresh(index: int, trace: str, limit: int | None) -> dict:
    cmd = [sys.executable, __file__, "--row", str(index), "--trace", trace]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def bench_match(tokens: int = 32_768, page_size: int = 16, pieces: int = 1, n: int = 3000) -> dict:
    """Median seconds of one match_prefix of a cached ``tokens``-token prompt (int32
    array) whose path has ``pieces`` nodes (cached by ``pieces`` growing requests)."""
    from tpcache.cache.radix import CacheConfig, RadixCache

    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50_000, size=tokens, dtype=np.int32)
    cache = RadixCache(CacheConfig(4 * tokens, page_size))
    for i in range(1, pieces + 1):
        cache.admit(i, prompt[: tokens * i // pieces])
        cache.finish(i)
    assert cache.match_prefix(prompt).prefix_len == tokens
    for _ in range(200):  # warm up
        cache.match_prefix(prompt)
    samples = []
    clock = time.perf_counter
    for _ in range(n):
        t = clock()
        cache.match_prefix(prompt)
        samples.append(clock() - t)
    return {
        "tokens": tokens,
        "nodes_on_path": pieces,
        "median_us": round(statistics.median(samples) * 1e6, 2),
        "p10_us": round(float(np.percentile(samples, 10)) * 1e6, 2),
    }


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.node()} ({os.cpu_count()} cpus, {platform.machine()}, Python "
        f"{platform.python_version()}, load average {load})"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--repeat", type=int, default=1, help="rounds of runs; medians are shown")
    p.add_argument(
        "--trace",
        default=str(TRACE),
        help="Mooncake-format trace (default: the one in tpcache/data/)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--only", nargs="*", default=None, help="run only the rows whose name contains one of these"
    )
    p.add_argument("--row", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.row is not None:
        print(json.dumps(run_row(args.row, args.trace, args.limit)))
        return 0

    chosen = [
        i
        for i, spec in enumerate(ROWS)
        if not args.only or any(word in spec["name"] for word in args.only)
    ]
    # Rounds: every chosen row once per round, so that a ratio between two rows compares
    # runs made moments apart (a shared machine's load drifts over minutes).
    rounds = [
        {i: run_row_fresh(i, args.trace, args.limit) for i in chosen}
        for _ in range(max(1, args.repeat))
    ]
    rows = []
    for i in chosen:
        runs = [r[i] for r in rounds]
        mid = sorted(runs, key=lambda r: r["cache_ops_s"])[(len(runs) - 1) // 2]
        mid["cache_ops_s_runs"] = [round(r["cache_ops_s"], 3) for r in runs]
        mid["cpu_s_runs"] = [r["cpu_s"] for r in runs]
        ref = next((j for j in chosen if ROWS[j]["name"] == ROWS[i].get("vs")), None)
        if ref is not None:
            mid["ratio_runs"] = [
                round(r[i]["cache_ops_s"] / r[ref]["cache_ops_s"], 3) for r in rounds
            ]
            mid["cpu_ratio_runs"] = [round(r[i]["cpu_s"] / r[ref]["cpu_s"], 3) for r in rounds]
        rows.append(mid)
    matches = [bench_match(pieces=1), bench_match(pieces=32)]
    result = {"machine": machine(), "limit": args.limit, "replay": rows, "match_32k": matches}
    if args.json:
        print(json.dumps(result))
        return 0

    print(f"machine: {result['machine']}")
    print(f"trace: {args.trace}" + (f" (first {args.limit} requests)" if args.limit else ""))
    head = f"{'row':<18}{'hit rate':>9}{'ops s':>8}{'cpu s':>8}{'admit us':>10}{'finish us':>10}{'evict us':>10}{'RSS MB':>9}"
    print(head)
    for r, spec in zip(rows, [ROWS[i] for i in chosen], strict=True):
        print(
            f"{r['name']:<18}{r['hit_rate']:>9.4f}{r['cache_ops_s']:>8.3f}{r['cpu_s']:>8.3f}"
            f"{r['match_us_median']:>10}{r['insert_us_median']:>10}{r['evict_us_median']:>10}"
            f"{r['peak_rss_mb']:>9}"
        )
        if "target_s" in spec and not args.limit:
            print(
                f"{'':<18}cache ops / target {spec['target_s']} s: {r['cache_ops_s'] / spec['target_s']:.2f}x"
                f" (cpu {r['cpu_s'] / spec['target_s']:.2f}x)"
            )
        if "target_rss_mb" in spec and not args.limit:
            print(
                f"{'':<18}peak RSS / target {spec['target_rss_mb']} MB: {r['peak_rss_mb'] / spec['target_rss_mb']:.2f}x"
            )
        if "ratio_runs" in r:
            ops = statistics.median(r["ratio_runs"])
            cpu = statistics.median(r["cpu_ratio_runs"])
            print(
                f"{'':<18}vs {spec['vs']}, median of per-round ratios: cache ops {ops:.2f}x,"
                f" cpu {cpu:.2f}x"
                f" (target {spec['target_x']}x: {ops / spec['target_x']:.2f}, cpu {cpu / spec['target_x']:.2f});"
                f" tombstones {r['tombstones_end']:,} at the end, SWA cached {r['swa_cached_tokens_end']:,}"
            )
        if len(r["cache_ops_s_runs"]) > 1:
            print(f"{'':<18}runs: ops s {r['cache_ops_s_runs']}, cpu s {r['cpu_s_runs']}")
            if "ratio_runs" in r:
                print(f"{'':<18}per-round ratios: ops {r['ratio_runs']}, cpu {r['cpu_ratio_runs']}")
    for m in matches:
        print(
            f"match_prefix of a cached {m['tokens']}-token int32 prompt, {m['nodes_on_path']} node(s)"
            f" on its path: median {m['median_us']} us (p10 {m['p10_us']} us),"
            f" {m['median_us'] / MATCH_TARGET_US:.2f}x the {MATCH_TARGET_US:.0f} us target"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
