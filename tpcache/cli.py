"""The ``tpcache`` command line. Each subcommand imports what it needs when it runs,
so ``tpcache replay`` never pays for Ray or torch."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
)


def _capacity(text: str) -> int | None:
    if text.lower() in ("inf", "infinite", "none"):
        return None
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capacity must be a token count or 'inf', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"capacity must be >= 1 token, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """The trace options shared by ``replay`` and ``demo``."""
    p.add_argument(
        "--capacity", type=_capacity, default=None, help="cache size in tokens, or 'inf' (default)"
    )
    p.add_argument("--page-size", type=_positive, default=16, help="tokens per page (default 16)")
    p.add_argument("--policy", default="lru", help="eviction policy (default lru)")
    p.add_argument("--limit", type=_positive, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_replay(args: argparse.Namespace) -> int:
    from tpcache.cache.policies import POLICIES
    from tpcache.replay import ReplayOptions, replay, terminal_progress
    from tpcache.trace import TraceError, load_trace

    if args.policy not in POLICIES:
        print(
            f"tpcache replay: unknown policy {args.policy!r}; known: {', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    try:
        requests = load_trace(args.trace, args.limit)
    except (OSError, TraceError) as exc:
        print(f"tpcache replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("tpcache replay: the trace has no requests", file=sys.stderr)
        return 2
    opts = ReplayOptions(capacity=args.capacity, page_size=args.page_size, policy=args.policy)
    summary = replay(requests, opts, None if args.json else terminal_progress)
    summary["machine"] = machine()
    if args.json:
        print(json.dumps(summary))
    else:
        cap = "inf" if summary["capacity_tokens"] is None else f"{summary['capacity_tokens']:,}"
        print(
            f"replayed {summary['requests']:,} requests, page {opts.page_size}, capacity {cap}, policy {opts.policy}"
        )
        print(
            f"  hit rate        {summary['hit_rate']:.4f}  ({summary['matched_tokens']:,} of {summary['prompt_tokens']:,} prompt tokens)"
        )
        print(
            f"  evicted tokens  {summary['evicted_tokens']:,} in {summary['evict_calls']:,} calls"
        )
        print(
            f"  cache ops       {summary['cache_ops_s']:.3f} s   medians: admit {summary['match_us_median']} us, finish {summary['insert_us_median']} us, evict {summary['evict_us_median']} us"
        )
        print(f"  peak RSS        {summary['peak_rss_mb']} MB   on {summary['machine']}")
    return 0


def machine() -> str:
    import os

    return f"{platform.node()} ({os.cpu_count()} cpus, {platform.machine()}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpcache", description="One prefix KV cache for a tensor-parallel group."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the cache alone")
    p.add_argument(
        "trace",
        nargs="?",
        default=str(DEFAULT_TRACE),
        help="JSONL trace (default: the shared Mooncake trace)",
    )
    add_trace_options(p)
    p.set_defaults(func=_cmd_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
