"""The host tier's cost in speed: ``tpcache replay`` with the host tier against the
single-tier replay, in interleaved rounds (single, host, same size, single, host, ...),
so that a load change on a shared machine hits every side of a round alike. Two
single-tier baselines:

- ``single``: the device pool alone (``--capacity``), the replay the tier is added to;
- ``same size``: one device pool of ``--capacity`` + ``--host-capacity`` tokens, which
  keeps what the two tiers keep together (the hit figures are the host tier's), so it
  does the same matching work; what the host tier costs beyond it is the tiering itself
  (``--no-same-size`` leaves it out).

Prints each round's cache-ops times (wall and CPU) and ratios, the medians, and the
machine with its load average before and after; checks that every run of a side reports
the same hit figures. Each run is a fresh ``tpcache replay --json`` process.

    .venv/bin/python scripts/bench_host_replay.py [--pairs 5] [--capacity 3000000]
        [--host-capacity 30000000] [--page-size 16] [--write-policy write_back]
        [--no-same-size] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

# The figures that must not change between runs (nor with a faster implementation).
HITS = (
    "hit_rate",
    "device_hit_tokens",
    "host_hit_tokens",
    "loaded_tokens",
    "written_back_tokens",
    "host_evicted_tokens",
)


def replay(args: argparse.Namespace, host: bool, capacity: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "tpcache", "replay", "--json",
           "--capacity", str(capacity or args.capacity), "--page-size", str(args.page_size)]  # fmt: skip
    if host:
        cmd += ["--host-capacity", str(args.host_capacity), "--write-policy", args.write_policy]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=3_000_000)
    ap.add_argument("--host-capacity", type=int, default=30_000_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--write-policy", default="write_back")
    ap.add_argument("--no-same-size", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()
    pairs = []
    hits: dict[str, set] = {"single": set(), "host": set(), "same": set()}
    for i in range(args.pairs):
        single, host = replay(args, False), replay(args, True)
        runs = {"single": single, "host": host}
        if not args.no_same_size:
            runs["same"] = replay(args, False, args.capacity + args.host_capacity)
        for side, run in runs.items():
            hits[side].add(tuple(run.get(k) for k in HITS))
        pair = {
            "single_s": round(single["cache_ops_s"], 3),
            "host_s": round(host["cache_ops_s"], 3),
            "single_cpu_s": round(single["cache_ops_cpu_s"], 3),
            "host_cpu_s": round(host["cache_ops_cpu_s"], 3),
            "ratio": round(host["cache_ops_s"] / single["cache_ops_s"], 3),
            "cpu_ratio": round(host["cache_ops_cpu_s"] / single["cache_ops_cpu_s"], 3),
            "load": round(os.getloadavg()[0], 2),
        }
        if "same" in runs:
            same = runs["same"]
            pair["same_s"] = round(same["cache_ops_s"], 3)
            pair["same_cpu_s"] = round(same["cache_ops_cpu_s"], 3)
            pair["ratio_same"] = round(host["cache_ops_s"] / same["cache_ops_s"], 3)
            pair["cpu_ratio_same"] = round(host["cache_ops_cpu_s"] / same["cache_ops_cpu_s"], 3)
        pairs.append(pair)
        if not args.json:
            print(f"round {i + 1}: {pair}", flush=True)
    if any(len(v) > 1 for v in hits.values()):
        raise SystemExit(f"hit figures differ between runs: {hits}")
    out = {
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip()
        + f", {os.cpu_count()} cpus, Python {platform.python_version()}",
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "write_policy": args.write_policy,
        "pairs": len(pairs),
        "single_s_median": statistics.median(p["single_s"] for p in pairs),
        "host_s_median": statistics.median(p["host_s"] for p in pairs),
        "ratio_median": statistics.median(p["ratio"] for p in pairs),
        "cpu_ratio_median": statistics.median(p["cpu_ratio"] for p in pairs),
        "host_hits": dict(zip(HITS, next(iter(hits["host"])), strict=True)),
        "single_hit_rate": next(iter(hits["single"]))[0],
    }
    if not args.no_same_size:
        out["same_size_capacity"] = args.capacity + args.host_capacity
        out["same_s_median"] = statistics.median(p["same_s"] for p in pairs)
        out["ratio_same_median"] = statistics.median(p["ratio_same"] for p in pairs)
        out["cpu_ratio_same_median"] = statistics.median(p["cpu_ratio_same"] for p in pairs)
        out["same_hit_rate"] = next(iter(hits["same"]))[0]
    if args.json:
        out["pair_runs"] = pairs
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>17}: {v}")


if __name__ == "__main__":
    main()
