"""``tpcache generate``: a trace's requests generated over the cache by concurrent
clients, with the prefix cache and without it (``harness/generate.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tpcache.cli.args import (
    add_count_option,
    add_namespace_options,
    add_scale_option,
    add_tp_option,
    add_trace_options,
    machine,
    picked,
    seconds_arg,
)
from tpcache.cli.capacity import capacity_problem, largest
from tpcache.cli.log_options import add_log_options


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a trace's requests with a model on a TP group, sent by concurrent "
        "clients over ZMQ, with the prefix cache and without it",
        description="The first --limit requests of a Mooncake trace, every length scaled "
        "by --scale, sent by --clients concurrent clients over ZMQ to a continuous-"
        "batching loop that runs the built-in reference model on --tp thread ranks (gloo); "
        "once with the prefix cache, once without (nothing cached, every admit misses). "
        "Prints prefill tokens computed, tokens/s, time to first token and end-to-end "
        "time of both, and the prefill tokens `tpcache replay --scale` says to expect.",
    )
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="Mooncake-format JSONL trace, plain or gzip (default: the conversation trace "
        "in the repository)",
    )
    add_trace_options(p)
    add_scale_option(p)
    p.set_defaults(limit=1000, scale=128)
    add_namespace_options(p, "every request in the namespace of this tenant cache salt (once)")
    add_tp_option(p)
    add_count_option(p, "--clients", 32, "concurrent clients")
    add_count_option(
        p, "--step-tokens", 512, "token budget of one step: prefill chunks and decodes"
    )
    g = p.add_argument_group("the reference model (random weights from --seed)")
    add_count_option(g, "--hidden", 256, "hidden size")
    add_count_option(g, "--heads", 8, "attention heads")
    add_count_option(g, "--ffn", 2048, "MLP size")
    add_count_option(g, "--layers", 8, "layers")
    g.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    p.add_argument(
        "--timeout",
        type=seconds_arg,
        default=120.0,
        help="seconds before a silent client, loop or rank is an error (default 120)",
    )
    add_log_options(p, ray=False)  # thread ranks in this process
    p.set_defaults(func=cmd_generate, parser=p)


def cmd_generate(args: argparse.Namespace) -> int:
    from tpcache.cache.policy.policies import CACHE_POLICIES
    from tpcache.harness.gen_wire import GenerateError
    from tpcache.harness.generate import GenerateOptions, ModelSize, run_generate, scaled_requests
    from tpcache.trace import DEFAULT_TRACE, TraceError, load_trace

    if args.policy not in CACHE_POLICIES:
        args.parser.error(f"unknown policy {args.policy!r}; known: {', '.join(CACHE_POLICIES)}")
    if (small := capacity_problem(args.capacity, args.page_size)) is not None:
        return _fail(small)
    try:
        opts = GenerateOptions(
            **picked(
                args, "scale", "page_size", "policy", "capacity", "tp", "clients", "step_tokens"
            ),
            model=ModelSize(args.hidden, args.heads, args.ffn, args.layers, args.seed),
            timeout_s=args.timeout,
            salt=args.salt[-1] if args.salt else None,
            lora_id=args.lora_id,
        )
        if len(args.salt) > 1:
            raise GenerateError("--salt may be given once here")
    except GenerateError as exc:
        args.parser.error(str(exc))
    try:
        trace = load_trace(args.trace or DEFAULT_TRACE, args.limit)
        requests = scaled_requests(trace, opts.scale)
    except (OSError, TraceError, GenerateError) as exc:  # (GenerateError: no requests)
        return _fail(str(exc))
    need = largest((r.prompt.size, r.max_new) for r in requests)
    if (small := capacity_problem(opts.capacity, opts.page_size, need)) is not None:
        return _fail(small)
    try:
        s = run_generate(trace, opts, _Progress())
    except GenerateError as exc:
        return _fail(str(exc))
    s["workload"] = str(args.trace or DEFAULT_TRACE)
    s["machine"] = machine()
    ok = s["prefill_equals_replay"] and s["nothing_held"] and s["rank_digests_equal"]
    if args.json:
        print(json.dumps(s))
        return 0 if ok else 1
    _print(s)
    return 0 if ok else 1


def _fail(message: str) -> int:
    print(f"tpcache generate: {message}", file=sys.stderr)
    return 2


class _Progress:
    """A line on stderr every 10 s: which run, requests done."""

    def __init__(self) -> None:
        self.next = time.monotonic() + 10.0

    def __call__(self, mode: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + 10.0
            print(f"generate: {mode}: {done:,}/{total:,} requests", file=sys.stderr, flush=True)


def _print(s: dict) -> None:
    m = s["model"]
    on, off = s["cache"], s["no_cache"]
    print(
        f"generate: {s['requests']:,} requests of {s['workload']}, scale {s['scale']}, page "
        f"{s['page_size']}, TP={s['tp']} {s['ranks']}, {s['clients']} clients over ZMQ"
    )
    print(
        f"  model           reference runner: vocab {m['vocab']:,}, hidden {m['hidden']}, "
        f"{m['heads']} heads, ffn {m['ffn']}, {m['num_layers']} layers; on {s['machine']}"
    )
    print(f"  {'':15} {'cache':>12} {'no cache':>12}")
    rows = [
        ("prompt tokens", "prompt_tokens", ","),
        ("matched", "matched_tokens", ","),
        ("prefill computed", "prefill_tokens_computed", ","),
        ("generated", "generated_tokens", ","),
        ("end-to-end s", "e2e_s", ".2f"),
        ("tokens/s", "tokens_per_s", ".1f"),
        ("TTFT p50 ms", "ttft_ms_p50", ".1f"),
        ("TTFT p99 ms", "ttft_ms_p99", ".1f"),
        ("steps", "steps", ","),
        ("admission waits", "admission_waits", ","),
    ]
    for label, key, fmt in rows:
        print(f"  {label:15} {on[key]:>12{fmt}} {off[key]:>12{fmt}}")
    expected = s["replay_prompt_tokens"] - s["replay_matched_tokens"]
    print(
        f"  replay          {s['replay_matched_tokens']:,} matched of "
        f"{s['replay_prompt_tokens']:,}: expects {expected:,} computed -> "
        f"{'equal' if s['prefill_equals_replay'] else 'DIFFERENT'}"
    )
    # The ratio and the hit rate it came from, as figures (--json also gives the
    # ``1 - hit/2`` reference as time_target).
    print(
        f"  time            with the cache {s['time_ratio']:.3f} of the time without it, "
        f"at a hit rate of {on['hit_rate']:.3f}"
    )
    print(
        f"  at the end      held {on['held_tokens_end']} / {off['held_tokens_end']} tokens, "
        f"rank digests {'equal' if s['rank_digests_equal'] else 'DIFFER'}"
    )
