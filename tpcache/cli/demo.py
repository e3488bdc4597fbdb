"""``tpcache demo``: a TP group of Ray actors driven with a trace, lockstep verified."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tpcache.cli.args import (
    add_count_option,
    add_group_options,
    add_host_options,
    add_trace_options,
    group_config,
    machine,
)
from tpcache.cli.capacity import capacity_problem, largest
from tpcache.cli.log_options import add_log_options


def add_demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="drive a TP group (Ray actors) with a trace and verify lockstep"
    )
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="Mooncake-format JSONL trace, plain or gzip (default: a synthetic multi-turn "
        "chat, 192 requests)",
    )
    add_trace_options(p)
    add_group_options(p)
    add_host_options(p)
    add_count_option(p, "--batch", 8, "requests per step")
    add_log_options(p)
    p.set_defaults(func=cmd_demo, parser=p)


class DemoProgress:
    """How far the demo has got, on ``stream`` (stderr: stdout is the summary's).

    On a terminal, one counter rewritten in place; anywhere else, plain lines: the first
    once ``quiet_s`` have passed (a short run prints nothing), then one every
    ``every_s``, and a last one at the end if any was written. ``clock`` is read on
    construction and at each call."""

    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet_s: float = 3.0,
        every_s: float = 5.0,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.clock = clock
        self.every_s = every_s
        self.started = clock()
        self.next_line = self.started + quiet_s  # set by __call__: when a line is due
        self.wrote = False  # set by __call__: a plain line was written

    def __call__(self, done: int, total: int, verified: int) -> None:
        now = self.clock()
        text = (
            f"{done:,}/{total:,} requests, {verified:,} steps verified, {now - self.started:.0f} s"
        )
        if self.tty:
            end = "\n" if done == total else ""
            print(f"\r  {text}", end=end, file=self.stream, flush=True)
            return
        if now < self.next_line and not (done == total and self.wrote):
            return
        self.wrote = True
        self.next_line = now + self.every_s
        print(f"demo: {text}", file=self.stream, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from tpcache.cache.policy.policies import POLICIES
    from tpcache.coordinator.cluster import ClusterJoinError, join
    from tpcache.errors import TpcacheError
    from tpcache.frontend.service import start_group
    from tpcache.harness.demo import needed_capacity, run_demo, synthetic_chat, trace_requests
    from tpcache.trace import TraceError

    if args.policy not in POLICIES:
        args.parser.error(f"unknown policy {args.policy!r}; known: {', '.join(POLICIES)}")
    try:
        requests = trace_requests(args.trace, args.limit) if args.trace else synthetic_chat()
    except (OSError, TraceError) as exc:
        print(f"tpcache demo: {exc}", file=sys.stderr)
        return 2
    if args.limit and not args.trace:
        requests = requests[: args.limit]
    need = largest((r.prompt.size, r.output.size) for r in requests)
    if (small := capacity_problem(args.capacity, args.page_size, need)) is not None:
        print(f"tpcache demo: {small}", file=sys.stderr)
        return 2
    capacity = args.capacity or needed_capacity(requests, args.page_size)
    try:
        config = group_config(args, capacity)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        join(args.address, worker_logs=args.worker_logs)
    except ClusterJoinError as exc:
        print(f"tpcache demo: {exc}", file=sys.stderr)
        return 2
    try:
        coord = start_group(config)
    except TpcacheError as exc:  # a rank refused the group, or Ray could not place it
        print(
            f"tpcache demo: the group did not start: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    try:
        summary = run_demo(coord, requests, args.batch, DemoProgress(sys.stderr))
    finally:
        coord.close()
    summary["workload"] = args.trace or "synthetic multi-turn chat"
    summary["machine"] = machine()
    ok = summary["lockstep_verified"]
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, args.batch)
    return 0 if ok else 1


def _print_summary(s: dict, batch: int) -> None:
    ok = s["lockstep_verified"]
    print(f"demo: TP={s['tp']} on {s['machine']}, workload {s['workload']}")
    print(f"  requests        {s['requests']:,} in {s['steps']:,} steps ({batch} per step)")
    print(
        f"  hit rate        {s['hit_rate']:.4f}  ({s['matched_tokens']:,} of {s['prompt_tokens']:,} prompt tokens)"
    )
    print(f"  capacity        {s['capacity_tokens']:,} tokens, evicted {s['evicted_tokens']:,}")
    if "host_capacity_tokens" in s:
        print(
            f"  host tier       {s['host_capacity_tokens']:,} tokens; hits {s['device_hit_tokens']:,}"
            f" on the device, {s['host_hit_tokens']:,} loaded from the host; written back"
            f" {s['written_back_tokens']:,}, dropped {s['host_evicted_tokens']:,}"
        )
    print(
        f"  steps/s         {s['steps_per_s']:.1f}  ({s['steps']:,} steps in {s['elapsed_s']:.1f} s)"
    )
    print(
        f"  step submit     {s['step_submit_ms_median']:.2f} ms median: the calls of one step, "
        "as the frontend waits for them"
    )
    print(
        f"  step latency    {s['step_latency_ms_median']:.2f} ms median, from a step's close to "
        "every rank's verified result: includes queueing behind the steps submitted before it"
    )
    print(f"  ranks reached   {', '.join(s['rank_paths'])}")
    print(f"  rank digests    {[f'{d:#018x}' for d in s['rank_digests']]}")
    print(
        f"lockstep verified: {s['steps']} steps, {s['divergences']} divergences"
        if ok
        else "LOCKSTEP FAILED"
    )
