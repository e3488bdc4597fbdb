"""Page-level prefix-cache hit rates of a Mooncake trace under LRU, Belady,
admit-on-second-sighting LRU and an infinite cache: reference figures for tpcache.

    python scripts/belady.py [TRACE] --capacity 3M,1M --page-size 16 [--tree] [--json]

TRACE defaults to the conversation trace in the repository, tpcache/data/mooncake_conversation.jsonl.gz.

Semantics are in ``pagesim`` (this is its command line). Belady here is the page-level
farthest-next-use rule, an upper reference for the online policies, not a proof of
optimality for prefix caching. Prints ratios, not verdicts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

# scripts/ is not a package and tpcache need not be installed: import both by path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from page_replay import build_replay, next_uses  # noqa: E402
from pagesim import POLICIES, Policy, SimResult, simulate  # noqa: E402

from tpcache.trace import DEFAULT_TRACE, load_trace  # noqa: E402

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_capacities(text: str) -> list[float]:
    """``"3M,1_000_000,inf"`` -> ``[3000000, 1000000, inf]``; tokens, k/M/G suffixes."""
    out: list[float] = []
    for part in text.split(","):
        item = part.strip().lower().replace("_", "")
        if item in ("inf", "infinite"):
            out.append(math.inf)
            continue
        scale = _SUFFIXES.get(item[-1:], 1)
        try:
            value = float(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a capacity: {part!r}") from None
        if not (value >= 0 and value == int(value)):
            raise argparse.ArgumentTypeError(f"capacity must be a whole number >= 0: {part!r}")
        out.append(int(value))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "trace",
        nargs="?",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL trace, plain or gzip (default: the one in tpcache/data/)",
    )
    parser.add_argument(
        "--capacity",
        action="append",
        type=parse_capacities,
        help="cache size in tokens; repeatable or a comma list; k/M/G suffixes, inf "
        "(default: 3M,1M)",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N")
    parser.add_argument(
        "--policy", action="append", choices=POLICIES, help="repeatable (default: all)"
    )
    parser.add_argument("--tree", action="store_true", help="evict only leaf pages")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _capacity_text(capacity: float) -> str:
    return "inf" if math.isinf(capacity) else f"{int(capacity):,}"


def _print_table(report: dict[str, object], results: list[tuple[SimResult, float]]) -> None:
    print(
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['prompt_tokens']:,} prompt tokens; page {report['page_size']}, "
        f"{'tree (leaf-only eviction)' if report['tree'] else 'plain page-level'} mode"
    )
    print(f"{'policy':<12} {'capacity':>12} {'hit rate':>9} {'evicted pages':>14} {'s':>7}")
    for res, seconds in results:
        print(
            f"{res.policy:<12} {_capacity_text(res.capacity_tokens):>12} "
            f"{res.hit_rate:>9.4f} {res.evicted_pages:>14,} {seconds:>7.1f}"
        )
    print(
        f"machine {report['machine']} ({report['cpus']} CPUs); build {report['build_s']:.1f} s, "
        f"total {report['total_s']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    capacities = [c for group in args.capacity or [[3_000_000, 1_000_000]] for c in group]
    policies: list[Policy] = args.policy or list(POLICIES)
    start = time.perf_counter()
    requests = load_trace(args.trace, args.limit)
    replay = build_replay(requests, args.page_size)
    future = next_uses(replay) if "belady" in policies else None
    build_s = time.perf_counter() - start
    results: list[tuple[SimResult, float]] = []
    for policy in dict.fromkeys(policies):
        # "inf" ignores the capacity, so it runs once.
        for capacity in [math.inf] if policy == "inf" else capacities:
            t0 = time.perf_counter()
            res = simulate(replay, policy, capacity, tree=args.tree, next_use=future)
            results.append((res, time.perf_counter() - t0))
    report: dict[str, object] = {
        "trace": str(args.trace),
        "requests": len(requests),
        "prompt_tokens": replay.prompt_tokens,
        "page_size": args.page_size,
        "tree": args.tree,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "build_s": round(build_s, 2),
        "total_s": round(time.perf_counter() - start, 2),
    }
    if args.json:
        report["results"] = [
            {
                "policy": res.policy,
                "capacity_tokens": None if math.isinf(res.capacity_tokens) else res.capacity_tokens,
                "hit_tokens": res.hit_tokens,
                "hit_rate": res.hit_rate,
                "evicted_pages": res.evicted_pages,
                "seconds": round(seconds, 2),
            }
            for res, seconds in results
        ]
        print(json.dumps(report))
    else:
        _print_table(report, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
