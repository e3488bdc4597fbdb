"""The ``tpcache`` command line. Each subcommand imports what it needs when it runs,
so ``tpcache replay`` never pays for Ray or torch."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys


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


def seconds_arg(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
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


def _add_swa_options(p: argparse.ArgumentParser) -> None:
    """The hybrid (full + sliding-window) cache options of ``replay``."""
    p.add_argument(
        "--swa-window",
        type=_positive,
        default=None,
        help="sliding window in tokens: replay through the hybrid SWA cache",
    )
    p.add_argument(
        "--swa-capacity",
        type=_capacity,
        default=None,
        help="SWA pool size in tokens (default: as large as the full pool)",
    )


def _cmd_replay(args: argparse.Namespace) -> int:
    from tpcache.cache.errors import CacheError
    from tpcache.cache.policies import CACHE_POLICIES
    from tpcache.replay import Progress, ReplayOptions, replay
    from tpcache.trace import DEFAULT_TRACE, TraceError, load_trace

    if args.policy not in CACHE_POLICIES:
        print(
            f"tpcache replay: unknown policy {args.policy!r}; known: {', '.join(CACHE_POLICIES)}",
            file=sys.stderr,
        )
        return 2
    try:
        requests = load_trace(args.trace or DEFAULT_TRACE, args.limit)
    except (OSError, TraceError) as exc:
        print(f"tpcache replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("tpcache replay: the trace has no requests", file=sys.stderr)
        return 2
    if args.swa_capacity is not None and args.swa_window is None:
        print("tpcache replay: --swa-capacity needs --swa-window", file=sys.stderr)
        return 2
    opts = ReplayOptions(
        capacity=args.capacity,
        page_size=args.page_size,
        policy=args.policy,
        swa_window=args.swa_window,
        swa_capacity=args.swa_capacity,
    )
    try:
        # Progress goes to stderr either way: stdout stays the summary alone.
        summary = replay(requests, opts, Progress(sys.stderr))
    except CacheError as exc:
        print(f"tpcache replay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
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
        if opts.swa_window:
            print(
                f"  SWA window      {summary['swa_window']:,} tokens, pool {summary['swa_capacity_tokens']:,}; at the end: full {summary['full_cached_tokens_end']:,} cached, SWA {summary['swa_cached_tokens_end']:,} cached, {summary['swa_free_tokens_end']:,} free"
            )
            print(
                f"  tombstones      {summary['tombstones_end']:,} nodes ({summary['tombstone_tokens_end']:,} tokens) at the end, {summary['tombstoned_nodes_total']:,} made; SWA evicted {summary['swa_evicted_tokens']:,} tokens"
            )
        print(f"  peak RSS        {summary['peak_rss_mb']} MB   on {summary['machine']}")
    return 0


def init_ray(address: str | None, namespace: str | None = None) -> None:
    """Join the cluster at ``address`` (``auto``: the one ``ray start`` made here), or start
    a local one. Ray's token authentication stays on; see the README for tokens."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict = {"namespace": namespace, "log_to_driver": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(include_dashboard=False, **kwargs)


def _group_config(args: argparse.Namespace, capacity: int | None):  # -> GroupConfig
    from tpcache.coordinator.service import GroupConfig
    from tpcache.workers.spec import CacheSpec

    cache = CacheSpec(page_size=args.page_size, policy=args.policy)
    # A thin pool (one KV head per rank, 4 dims, fp16) keeps a CPU demo's memory small;
    # the index and the lockstep are what the demo exercises.
    bytes_per_slot = 2 * args.layers * 1 * args.head_dim * 2
    budget = (capacity or 1 << 20) * bytes_per_slot + (1 << 20)
    return GroupConfig(
        tp=args.tp,
        capacity_tokens=capacity,
        cache=cache,
        num_layers=args.layers,
        kv_heads=args.tp,
        head_dim=args.head_dim,
        dtype="float16",
        cpu_budget_bytes=budget,
        timeout_s=args.timeout,
        join_timeout_s=args.join_timeout,
    )


def _add_group_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_positive, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (e.g. auto); default: start a local one",
    )
    p.add_argument("--layers", type=_positive, default=1, help="KV-pool layers (default 1)")
    p.add_argument("--head-dim", type=_positive, default=4, help="KV-pool head dim (default 4)")
    p.add_argument(
        "--timeout",
        type=seconds_arg,
        default=60.0,
        help="collective timeout in seconds: how fast a hung rank is found (default 60)",
    )
    p.add_argument(
        "--join-timeout",
        type=seconds_arg,
        default=120.0,
        help="seconds ranks wait for each other to join the group, at start-up and after "
        "a rank is replaced (default 120)",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from tpcache.cache.policies import POLICIES
    from tpcache.coordinator.demo import needed_capacity, run_demo, synthetic_chat, trace_requests
    from tpcache.coordinator.service import start_group
    from tpcache.trace import TraceError

    if args.policy not in POLICIES:
        print(
            f"tpcache demo: unknown policy {args.policy!r}; known: {', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    try:
        requests = trace_requests(args.trace, args.limit) if args.trace else synthetic_chat()
    except (OSError, TraceError) as exc:
        print(f"tpcache demo: {exc}", file=sys.stderr)
        return 2
    if args.limit and not args.trace:
        requests = requests[: args.limit]
    capacity = args.capacity or needed_capacity(requests, args.page_size)
    init_ray(args.address)
    coord = start_group(_group_config(args, capacity))
    try:
        summary = run_demo(coord, requests, args.batch)
    finally:
        coord.close()
    summary["workload"] = args.trace or "synthetic multi-turn chat"
    summary["machine"] = machine()
    if args.json:
        print(json.dumps(summary))
        return 0 if summary["lockstep_verified"] else 1
    print(f"demo: TP={summary['tp']} on {summary['machine']}, workload {summary['workload']}")
    print(
        f"  requests        {summary['requests']:,} in {summary['steps']:,} steps ({args.batch} per step)"
    )
    print(
        f"  hit rate        {summary['hit_rate']:.4f}  ({summary['matched_tokens']:,} of {summary['prompt_tokens']:,} prompt tokens)"
    )
    print(
        f"  capacity        {summary['capacity_tokens']:,} tokens, evicted {summary['evicted_tokens']:,}"
    )
    print(
        f"  steps/s         {summary['steps_per_s']:.1f}   per-step latency median {summary['step_latency_ms_median']:.2f} ms"
    )
    ok = summary["lockstep_verified"]
    print(f"  rank digests    {[f'{d:#018x}' for d in summary['rank_digests']]}")
    print(
        f"lockstep verified: {summary['steps']} steps, {summary['divergences']} divergences"
        if ok
        else "LOCKSTEP FAILED"
    )
    return 0 if ok else 1


def _cmd_events(args: argparse.Namespace) -> int:
    from tpcache.coordinator.subscriber import run_events

    return run_events(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from tpcache.coordinator.event_config import EventConfig, EventConfigError
    from tpcache.coordinator.service import serve

    config = _group_config(args, args.capacity)
    try:
        if args.events_endpoint:
            events = EventConfig(
                endpoint=args.events_endpoint,
                replay_endpoint=args.events_replay_endpoint,
                topic=args.events_topic,
                buffer_steps=args.events_buffer,
                encoding=args.events_encoding,
                curve_secret_key=_read_key(args.events_curve_secret_file),
                curve_client_keys=_read_keys(args.events_curve_client_keys_file),
                insecure=args.events_insecure,
            )
            config = dataclasses.replace(config, events=events)
    except (EventConfigError, OSError) as exc:
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        config = dataclasses.replace(
            config, metrics_port=args.metrics_port, metrics_host=args.metrics_host
        )
    init_ray(args.address, args.namespace)
    actor = serve(config, args.name, args.namespace, args.detached)
    import ray

    stats = ray.get(actor.stats.remote())
    print(
        f"tpcache serving '{args.name}' in namespace '{args.namespace}': TP={args.tp}, capacity {stats['capacity']:,} tokens"
    )
    print(
        f"  frontends: tpcache.connect({args.name!r}, {args.namespace!r}) from any node of the cluster"
    )
    if args.events_endpoint:
        print(
            f"  KV events on {args.events_endpoint} (replay: {args.events_replay_endpoint}); read them with `tpcache events`"
        )
    if stats.get("metrics_port") is not None:
        print(f"  Prometheus metrics on port {stats['metrics_port']} (/metrics)")
    if args.detached:
        print(
            "  detached: it keeps running after this command exits (ray kill / ray stop to end it)"
        )
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ray.get(actor.shutdown.remote())
    return 0


def _read_key(path: str | None) -> str | None:
    """A CURVE key kept in a file (its first line)."""
    if path is None:
        return None
    with open(path) as f:
        return f.readline().strip()


def _read_keys(path: str | None) -> tuple[str, ...]:
    """CURVE public keys, one per line (blank lines and # comments skipped)."""
    if path is None:
        return ()
    with open(path) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return tuple(line for line in lines if line)


def _cmd_keys(args: argparse.Namespace) -> int:
    import os

    from tpcache.workers.netsec import new_keypair

    public, secret = new_keypair()
    fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    print(public)
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
        default=None,
        help="Mooncake-format JSONL trace, plain or gzip (default: the Mooncake "
        "conversation trace in the repository, data/mooncake_conversation.jsonl.gz)",
    )
    add_trace_options(p)
    _add_swa_options(p)
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "demo", help="drive a TP group (Ray actors) with a trace and verify lockstep"
    )
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="Mooncake-format JSONL trace (default: synthetic chat)",
    )
    add_trace_options(p)
    _add_group_options(p)
    p.add_argument("--batch", type=_positive, default=8, help="requests per step (default 8)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("serve", help="serve a TP group's coordinator as a named Ray actor")
    _add_group_options(p)
    p.add_argument(
        "--capacity", type=_capacity, default=1 << 20, help="KV slots per rank (default 1,048,576)"
    )
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--policy", default="lru")
    p.add_argument("--name", default="tpcache")
    p.add_argument("--namespace", default="tpcache")
    p.add_argument("--detached", action="store_true", help="outlive this command")
    p.add_argument(
        "--events-endpoint",
        default=None,
        help="publish KV events on this ZMQ endpoint (e.g. tcp://127.0.0.1:5557; a network "
        "address needs --events-curve-secret-file or --events-insecure); off by default",
    )
    p.add_argument(
        "--events-replay-endpoint",
        default=None,
        help="ROUTER endpoint for replay and snapshots (e.g. tcp://127.0.0.1:5558)",
    )
    p.add_argument(
        "--events-topic", default="", help="topic of every event message (default empty)"
    )
    p.add_argument(
        "--events-buffer",
        type=_positive,
        default=10_000,
        help="batches kept for replay (default 10,000)",
    )
    p.add_argument(
        "--events-encoding",
        choices=("map", "array"),
        default="map",
        help="events as maps (default) or as arrays, the form vLLM's subscriber decodes",
    )
    p.add_argument(
        "--events-curve-secret-file",
        default=None,
        metavar="PATH",
        help="CURVE secret key of the events sockets (from `tpcache keys`); needed on a "
        "network address, since events carry token ids",
    )
    p.add_argument(
        "--events-curve-client-keys-file",
        default=None,
        metavar="PATH",
        help="CURVE public keys (one a line) of the subscribers let in; default: any that "
        "knows the server's public key",
    )
    p.add_argument(
        "--events-insecure",
        action="store_true",
        help="allow events on a network address without CURVE (anyone who reaches the "
        "port reads token ids)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port; off by default",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default loopback; 0.0.0.0 for all)",
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "keys", help="make a CURVE key pair: the secret into a new file, the public on stdout"
    )
    p.add_argument("secret_file", help="file to create (mode 0600) for the secret key")
    p.set_defaults(func=_cmd_keys)

    from tpcache.coordinator.subscriber import build_events_parser

    p = sub.add_parser("events", help="subscribe to a coordinator's KV events and print them")
    build_events_parser(p)
    p.set_defaults(func=_cmd_events)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
