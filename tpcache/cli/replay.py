"""``tpcache replay``: a trace through the cache state machine alone (no Ray, no torch)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tpcache.cli.args import (
    add_host_options,
    add_namespace_options,
    add_scale_option,
    add_trace_options,
    capacity_arg,
    host_args_error,
    machine,
    picked,
    positive_arg,
)
from tpcache.cli.capacity import capacity_problem, largest

if TYPE_CHECKING:
    from tpcache.replay import ReplayOptions
    from tpcache.trace import TraceRequest


def add_replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the cache alone")
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="Mooncake-format JSONL trace, plain or gzip (default: the Mooncake "
        "conversation trace in the repository, tpcache/data/mooncake_conversation.jsonl.gz)",
    )
    add_trace_options(p)
    add_scale_option(p)
    add_swa_options(p)
    add_host_options(p)
    add_namespace_options(
        p,
        "replay the trace in the namespace of this tenant cache salt; given several times, "
        "once per salt in one cache (equal prompts under two salts never share KV)",
    )
    p.set_defaults(func=cmd_replay)


def add_swa_options(p: argparse.ArgumentParser) -> None:
    """The hybrid (full + sliding-window) cache options of ``replay``."""
    p.add_argument(
        "--swa-window",
        type=positive_arg,
        default=None,
        help="sliding window in tokens: replay through the hybrid SWA cache",
    )
    p.add_argument(
        "--swa-capacity",
        type=capacity_arg,
        default=None,
        help="SWA pool size in tokens (default: as large as the full pool)",
    )


# The options ``ReplayOptions`` takes as they were given.
_AS_GIVEN = (
    "capacity",
    "page_size",
    "policy",
    "scale",
    "swa_window",
    "swa_capacity",
    "host_capacity",
    "lora_id",
)


def cmd_replay(args: argparse.Namespace) -> int:
    from tpcache.cache.errors import CacheError
    from tpcache.cache.policy.policies import CACHE_POLICIES
    from tpcache.replay import Progress, ReplayOptions, replay
    from tpcache.trace import DEFAULT_TRACE, TraceError, load_trace

    if args.policy not in CACHE_POLICIES:
        return _fail(f"unknown policy {args.policy!r}; known: {', '.join(CACHE_POLICIES)}")
    try:
        requests = load_trace(args.trace or DEFAULT_TRACE, args.limit)
    except (OSError, TraceError) as exc:
        return _fail(str(exc))
    if not requests:
        return _fail("the trace has no requests")
    mismatch = _mismatch(args)
    if mismatch is not None:
        return _fail(mismatch)
    try:
        opts = ReplayOptions(
            **picked(args, *_AS_GIVEN),
            write_policy=args.write_policy or "write_back",
            write_through_hits=args.write_through_hits or 2,
            salts=tuple(args.salt),
        )
        if (small := _capacity_problem(requests, opts)) is not None:
            return _fail(small)
        # Progress goes to stderr either way: stdout stays the summary alone.
        summary = replay(requests, opts, Progress(sys.stderr))
    except CacheError as exc:  # (the cache's own checks, should one pass this one's)
        return _fail(f"{type(exc).__name__}: {exc}")
    summary["machine"] = machine()
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, opts)
    return 0


def _fail(message: str) -> int:
    print(f"tpcache replay: {message}", file=sys.stderr)
    return 2


def _capacity_problem(requests: list[TraceRequest], opts: ReplayOptions) -> str | None:
    """``capacity_problem`` of each pool for the largest scaled request, or None."""
    k = opts.scale
    need = largest((-(-r.input_length // k), -(-r.output_length // k)) for r in requests)
    return capacity_problem(opts.capacity, opts.page_size, need) or capacity_problem(
        opts.swa_capacity if opts.swa_window else None, opts.page_size, need, "--swa-capacity"
    )


def _mismatch(args: argparse.Namespace) -> str | None:
    """Which options were given without the one they need, or None."""
    if args.swa_capacity is not None and args.swa_window is None:
        return "--swa-capacity needs --swa-window"
    return host_args_error(args)


def _print_summary(summary: dict, opts: ReplayOptions) -> None:
    cap = "inf" if summary["capacity_tokens"] is None else f"{summary['capacity_tokens']:,}"
    print(
        f"replayed {summary['requests']:,} requests, page {opts.page_size}, capacity {cap}, "
        f"policy {opts.policy}, scale {summary['scale']}"
    )
    print(
        f"  hit rate        {summary['hit_rate']:.4f}  ({summary['matched_tokens']:,} of {summary['prompt_tokens']:,} prompt tokens)"
    )
    print(f"  evicted tokens  {summary['evicted_tokens']:,} in {summary['evict_calls']:,} calls")
    print(
        f"  cache ops       {summary['cache_ops_s']:.3f} s   medians: admit {summary['match_us_median']} us, finish {summary['insert_us_median']} us, evict {summary['evict_us_median']} us"
    )
    if opts.swa_window:
        print(
            f"  SWA window      {summary['swa_window']:,} tokens, pool {summary['swa_capacity_tokens']:,}; at the end: full {summary['full_cached_tokens_end']:,} cached, SWA {summary['swa_cached_tokens_end']:,} cached, {summary['swa_free_tokens_end']:,} free"
        )
        print(
            f"  tombstones      {summary['tombstones_end']:,} nodes ({summary['tombstone_tokens_end']:,} tokens) at the end, {summary['tombstoned_nodes_total']:,} made; SWA evicted {summary['swa_evicted_tokens']:,} tokens"
        )
    if opts.host_capacity is not None:
        print(
            f"  host tier       {summary['host_capacity_tokens']:,} tokens, {summary['write_policy']}: device hits {summary['device_hit_tokens']:,}, host hits {summary['host_hit_tokens']:,}; loaded {summary['loaded_tokens']:,}, written {summary['written_back_tokens']:,}, dropped from the host {summary['host_evicted_tokens']:,}"
        )
    for one in summary.get("passes", []):
        print(
            f"  salt {one['salt']!r:<10} hit rate {one['hit_rate']:.4f}  ({one['matched_tokens']:,} of {one['prompt_tokens']:,})"
        )
    print(f"  peak RSS        {summary['peak_rss_mb']} MB   on {summary['machine']}")
