"""``tpcache serve`` and ``tpcache stop``: a TP group's coordinator as a named Ray actor,
and stopping it. Their options and the config they make are in ``serve_options.py``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tpcache.cli.args import add_cache_options, add_group_options, add_host_options
from tpcache.cli.capacity import capacity_problem
from tpcache.cli.log_options import LineRelay, add_log_options
from tpcache.cli.serve_model import ServeModelError, add_model_options, model_error
from tpcache.cli.serve_options import (
    add_events_options,
    add_name_options,
    metrics_host,
    serve_config,
    unpaired,
)


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a TP group's coordinator as a named Ray actor (--model: and generate)",
    )
    add_group_options(p)
    add_host_options(p)
    add_cache_options(
        p,
        None,
        "KV slots per rank (default 1,048,576; with a model, as many as 1 GiB holds on a "
        "CPU rank, or a GPU's free memory fraction)",
        "eviction policy: lru (default), lfu, fifo, mru, filo, priority, resight",
    )
    add_model_options(p)
    add_name_options(p)
    p.add_argument(
        "--detached",
        action="store_true",
        help="keep serving after this command exits (needs --address: a cluster that "
        "outlives it); end it with `tpcache stop`",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="stop a coordinator already served under this name first (its running "
        "requests are lost); without it, a taken name is an error",
    )
    add_events_options(p.add_argument_group("KV events and metrics (off by default)"))
    add_log_options(p, served=True)
    p.set_defaults(func=cmd_serve, parser=p)


def add_stop_parser(sub) -> None:
    p = sub.add_parser("stop", help="stop a served coordinator (e.g. a detached one)")
    add_name_options(p)
    p.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster it serves on (default: $RAY_ADDRESS if set, else the cluster "
        "`ray start` made on this machine)",
    )
    p.set_defaults(func=cmd_stop, parser=p)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from tpcache.cache.errors import CacheError
    from tpcache.coordinator.cluster import ClusterJoinError, join
    from tpcache.errors import TpcacheError
    from tpcache.events.event_config import EventConfigError
    from tpcache.events.metrics import MetricsError
    from tpcache.events.publisher import EventPublisherError
    from tpcache.frontend.netfront import FrontendConfigError
    from tpcache.frontend.service import AlreadyServing, find_served, serve, stop_served
    from tpcache.model.runner import RunnerConfigError

    small = capacity_problem(args.capacity, args.page_size)
    if (alone := unpaired(args) or model_error(args) or small) is not None:
        print(f"tpcache serve: {alone}", file=sys.stderr)
        return 2
    try:
        config, serving = serve_config(args)
    except (ServeModelError, RunnerConfigError) as exc:  # a model it cannot serve as asked
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    except (ValueError, CacheError) as exc:  # EventConfigError is one; an unknown policy
        args.parser.error(str(exc))  # (a model's config the runner refuses too)
    except OSError as exc:  # a key file
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    if args.detached and not (args.address or os.environ.get("RAY_ADDRESS")):
        args.parser.error(
            "--detached needs --address: a cluster this command starts ends with it (start "
            "one with `ray start --head`)"
        )
    try:
        joined = join(args.address, args.namespace, worker_logs=args.worker_logs)
    except ClusterJoinError as exc:
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    # After join: ray.init puts its own SIGTERM handler in, which exits mid-call.
    signal.signal(signal.SIGTERM, _interrupt)
    where = f"--name {args.name} --namespace {args.namespace} --address {joined.address}"
    try:
        actor = serve(
            config,
            args.name,
            args.namespace,
            args.detached,
            replace=args.replace,
            serving=serving,
            log_level=args.log_level.upper(),
        )
    except AlreadyServing as exc:
        print(
            f"tpcache serve: {exc}.\n  Stop it with `tpcache stop {where}`, or add --replace "
            "to stop it and serve this one.",
            file=sys.stderr,
        )
        return 1
    except (MetricsError, EventConfigError, EventPublisherError, FrontendConfigError) as exc:
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    except CacheError as exc:  # the pool holds less than a page: the model does not fit
        print(f"tpcache serve: the KV pool does not fit: {exc}", file=sys.stderr)
        return 2
    except TpcacheError as exc:  # a rank refused the group, or Ray could not place it
        print(
            f"tpcache serve: the group did not start: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 130
    # The actor's log lines: fetched and printed here, unless Ray forwards them.
    relay = None if args.worker_logs else LineRelay(actor)
    if relay is not None:
        relay()  # what the group's start logged, before the summary
    _print_serving(args, actor, joined.address, joined.started)
    if args.detached:
        print(f"  detached: it keeps serving after this command exits; `tpcache stop {where}`")
        return 0
    print(f"  Ctrl-C or SIGTERM here (or `tpcache stop {where}`) stops it", flush=True)
    try:
        while find_served(args.name, args.namespace) is not None:
            for _ in range(4):  # its lines every half second, whether it is there every 2
                time.sleep(0.5)
                if relay is not None:
                    relay()
        print(f"tpcache serve: {args.name!r} was stopped elsewhere", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time
        print(f"tpcache serve: stopping {args.name!r}", file=sys.stderr, flush=True)
        stop_served(actor, args.name, args.namespace)
    return 0


def _print_serving(args: argparse.Namespace, actor, address: str, started: bool) -> None:
    """Where the served coordinator is, and its endpoints (network, HTTP, events,
    metrics)."""
    import ray

    from tpcache.frontend.service import describe

    print(
        f"tpcache serving {args.name!r} in namespace {args.namespace!r}: {describe(actor)}",
        flush=True,
    )
    if started:
        print(f"  Ray cluster {address}, started by this command: it ends when it does")
    else:
        print(f"  Ray cluster {address}")
    print(
        f"  frontends: tpcache.connect({args.name!r}, {args.namespace!r}, "
        f"address={address!r}) from any node of the cluster"
    )
    ends = ray.get(actor.endpoints.remote())
    if args.model or args.runner:
        print(f"  model: {args.model or args.runner}; generate with either client's generate()")
    if ends["network"]:
        print(
            f"  network frontend on {ends['network']}: tpcache.client.NetworkClient({ends['network']!r})"
        )
    if ends["http"]:
        print(f"  OpenAI-compatible endpoint on {ends['http']}/v1/completions")
    if args.events_endpoint:
        print(
            f"  KV events on {args.events_endpoint} (replay: {args.events_replay_endpoint}); "
            f"read them with `tpcache events --endpoint {args.events_endpoint}`"
        )
    if args.metrics_port is not None:
        port = ray.get(actor.stats.remote())["metrics_port"]
        print(f"  Prometheus metrics on http://{metrics_host(args)}:{port}/metrics")


def cmd_stop(args: argparse.Namespace) -> int:
    from tpcache.coordinator.cluster import ClusterJoinError, join

    try:
        joined = join(args.address or "auto")
    except ClusterJoinError as exc:
        print(f"tpcache stop: {exc}", file=sys.stderr)
        return 2
    from tpcache.frontend.service import describe, find_served, stop_served  # torch: after

    actor = find_served(args.name, args.namespace)
    if actor is None:
        print(
            f"tpcache stop: no coordinator named {args.name!r} in namespace "
            f"{args.namespace!r} on the Ray cluster at {joined.address}",
            file=sys.stderr,
        )
        return 1
    what = describe(actor)
    stop_served(actor, args.name, args.namespace)
    print(f"stopped {args.name!r} in namespace {args.namespace!r} ({what})")
    return 0
