"""Hit rate against capacity for every eviction policy of the tree, with the page-level
references (LRU, offline Belady, admit-on-second-sighting LRU, infinite) drawn in.

    python scripts/sweep.py [TRACE] --capacity 0.5M,1M,2M,3M,5M,10M \\
        [--policy lru --policy resight ...] [--limit N] [--jobs 2] \\
        [--timing-repeat 3 --timing-capacity 3M --timing-policy resight] \\
        [--out results/policy_sweep]

TRACE defaults to the conversation trace in the repository, tpcache/data/mooncake_conversation.jsonl.gz.
Every (policy, capacity) is a ``tpcache.replay`` run of the whole trace (page 16 unless
``--page-size``), in worker processes (``--jobs``). The references come from
``pagesim`` (the independent page-level simulator of ``scripts/belady.py``). Writes
``OUT.md`` (the table), ``OUT.json`` (every figure) and ``OUT.png`` (the plot). With
``--timing-repeat K``, LRU and ``--timing-policy`` (default resight) are then replayed K
more times each at the timing capacity, one after another in this process, taking
turns, and the median cache-ops seconds and their ratio to LRU's are reported:
medians, because the machine may be shared. Prints ratios, not verdicts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# scripts/ is not a package: import the simulator by path, as belady.py does.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from belady import parse_capacities  # noqa: E402

from tpcache.cache.policy.policies import CACHE_POLICIES  # noqa: E402
from tpcache.replay import ReplayOptions, replay  # noqa: E402
from tpcache.trace import DEFAULT_TRACE as TRACE  # noqa: E402
from tpcache.trace import load_trace  # noqa: E402

REFERENCES = ("lru", "belady", "admit2-lru")  # pagesim policies, plus "inf" once


def _replay_one(trace: str, limit: int | None, policy: str, capacity: int, ps: int) -> dict:
    requests = load_trace(trace, limit)
    started = time.perf_counter()
    out = replay(requests, ReplayOptions(capacity=capacity, page_size=ps, policy=policy))
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out


def _references(trace: str, limit: int | None, capacities: list[int], ps: int) -> dict:
    from page_replay import build_replay, next_uses
    from pagesim import simulate

    rep = build_replay(load_trace(trace, limit), ps)
    future = next_uses(rep)
    out: dict[str, dict[int, float]] = {p: {} for p in REFERENCES}
    for policy in REFERENCES:
        for cap in capacities:
            res = simulate(rep, policy, cap, tree=True, next_use=future)  # type: ignore[arg-type]
            out[policy][cap] = res.hit_rate
    out["inf"] = {0: simulate(rep, "inf", math.inf, tree=True).hit_rate}  # type: ignore[dict-item]
    return out


def _fmt_cap(cap: int) -> str:
    return f"{cap / 1e6:g}M" if cap >= 1_000_000 else f"{cap / 1e3:g}k"


def _table(policies: list[str], capacities: list[int], hits: dict, refs: dict) -> str:
    head = "| policy | " + " | ".join(_fmt_cap(c) for c in capacities) + " |"
    lines = [head, "|" + "---|" * (len(capacities) + 1)]
    for p in policies:
        lines.append(f"| {p} | " + " | ".join(f"{hits[p][c]:.4f}" for c in capacities) + " |")
    for p in REFERENCES:
        cells = " | ".join(f"{refs[p][c]:.4f}" for c in capacities)
        lines.append(f"| *{p} (page sim)* | {cells} |")
    inf = refs["inf"][0]
    lines.append("| *infinite* | " + " | ".join(f"{inf:.4f}" for _ in capacities) + " |")
    return "\n".join(lines)


def _plot(path: Path, policies: list[str], capacities: list[int], hits: dict, refs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    xs = [c / 1e6 for c in capacities]
    for p in policies:
        bold = p in ("resight", "lru")
        ax.plot(xs, [hits[p][c] for c in capacities], marker="o", lw=2.2 if bold else 1, label=p)
    styles = {"belady": ("k", "--"), "lru": ("grey", "--"), "admit2-lru": ("grey", ":")}
    for p, (color, ls) in styles.items():
        ys = [refs[p][c] for c in capacities]
        ax.plot(xs, ys, color=color, ls=ls, lw=1.5, label=f"{p} (page sim)")
    ax.axhline(refs["inf"][0], color="k", lw=0.8, ls="-.", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xticks(xs, [_fmt_cap(c) for c in capacities])
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (prompt tokens)")
    ax.set_title("Eviction policies on the trace: hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def _timing(trace: str, limit: int | None, policies: list[str], cap: int, ps: int, k: int) -> dict:
    requests = load_trace(trace, limit)
    runs: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(k):
        for p in policies:
            out = replay(requests, ReplayOptions(capacity=cap, page_size=ps, policy=p))
            runs[p].append(out["cache_ops_s"])
    med = {p: statistics.median(v) for p, v in runs.items()}
    base = med.get("lru")
    return {
        p: {
            "runs_s": [round(x, 3) for x in runs[p]],
            "median_s": round(med[p], 3),
            "ratio_to_lru": round(med[p] / base, 3) if base else None,
        }
        for p in policies
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--capacity", type=parse_capacities, default=None)
    ap.add_argument("--policy", action="append", choices=CACHE_POLICIES)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timing-repeat", type=int, default=0)
    ap.add_argument("--timing-capacity", type=parse_capacities, default=[3_000_000])
    ap.add_argument("--timing-policy", action="append", choices=CACHE_POLICIES)
    ap.add_argument("--out", type=Path, default=Path("results/policy_sweep"))
    args = ap.parse_args(argv)
    caps = [int(c) for c in (args.capacity or [500_000, 1e6, 2e6, 3e6, 5e6, 10e6, 20e6])]
    policies = list(dict.fromkeys(args.policy or CACHE_POLICIES))
    ps = args.page_size
    started = time.perf_counter()
    results: dict[str, dict[int, dict]] = {p: {} for p in policies}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = {
            (p, c): pool.submit(_replay_one, args.trace, args.limit, p, c, ps)
            for c in caps
            for p in policies
        }
        refs_job = pool.submit(_references, args.trace, args.limit, caps, ps)
        for (p, c), job in jobs.items():
            results[p][c] = job.result()
            r = results[p][c]
            print(f"{p:>9} {_fmt_cap(c):>6}  hit {r['hit_rate']:.4f}  ops {r['cache_ops_s']:.2f} s")
        refs = refs_job.result()
    hits = {p: {c: results[p][c]["hit_rate"] for c in caps} for p in policies}
    table = _table(policies, caps, hits, refs)
    report: dict = {
        "trace": args.trace,
        "limit": args.limit,
        "page_size": ps,
        "machine": f"{platform.node()} ({os.cpu_count()} cpus)",
        "capacities": caps,
        "hit_rate": {p: {str(c): v for c, v in hits[p].items()} for p in policies},
        "cache_ops_s": {p: {str(c): results[p][c]["cache_ops_s"] for c in caps} for p in policies},
        "references": {p: {str(c): v for c, v in refs[p].items()} for p in refs},
    }
    if args.timing_repeat:
        tcap = int(args.timing_capacity[0])
        timed = list(dict.fromkeys(["lru", *(args.timing_policy or ["resight"])]))
        report["timing"] = {
            "capacity": tcap,
            "repeat": args.timing_repeat,
            **_timing(args.trace, args.limit, timed, tcap, ps, args.timing_repeat),
        }
    report["total_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = [
        f"Hit rate, page {ps}, {args.trace}" + (f" (first {args.limit})" if args.limit else ""),
        "",
        table,
    ]
    if "timing" in report:
        t = report["timing"]
        md += ["", f"Cache-ops seconds at {_fmt_cap(t['capacity'])}, median of {t['repeat']}:", ""]
        md += ["| policy | median s | ratio to lru | runs |", "|---|---|---|---|"]
        md += [
            f"| {p} | {t[p]['median_s']} | {t[p]['ratio_to_lru']} | {t[p]['runs_s']} |"
            for p in timed
        ]
    Path(f"{args.out}.md").write_text("\n".join(md) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(Path(f"{args.out}.png"), policies, caps, hits, refs)
    print("\n".join(md))
    print(f"wrote {args.out}.md, .json, .png in {report['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
