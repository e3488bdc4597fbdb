"""``tpcache serve``, ``tpcache stop`` and ``tpcache keys``: a TP group's coordinator as
a named Ray actor, stopping it, and the CURVE keys of its events sockets."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tpcache.cli.args import (
    add_cache_options,
    add_group_options,
    add_host_options,
    group_config,
    name_arg,
    picked,
    port_arg,
    positive_arg,
)

_EVENTS_BUFFER = 10_000
_METRICS_HOST = "127.0.0.1"
# Options that do nothing without another: the one they need, them, and why they need it.
_NEEDS = {
    "--events-endpoint": (
        (
            "--events-replay-endpoint",
            "--events-topic",
            "--events-buffer",
            "--events-encoding",
            "--events-curve-secret-file",
            "--events-curve-client-keys-file",
            "--events-insecure",
        ),
        "no KV events are published without it",
    ),
    "--metrics-port": (("--metrics-host",), "no metrics are served without it"),
}


def _value(args: argparse.Namespace, flag: str) -> object:
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


def _alone(args: argparse.Namespace) -> str | None:
    """Which options were given without the option they need (they would do nothing), or
    None. An option's default is None (False for a switch): any other value was given."""
    for needed, (flags, why) in _NEEDS.items():
        if _value(args, needed) not in (None, ""):  # ("" publishes nothing either)
            continue
        given = [flag for flag in flags if _value(args, flag) not in (None, False)]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            return f"{' and '.join(given)} {verb} {needed} ({why})"
    return None


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a TP group's coordinator as a named Ray actor")
    add_group_options(p)
    add_host_options(p)
    add_cache_options(
        p,
        1 << 20,
        "KV slots per rank (default 1,048,576)",
        "eviction policy: lru (default), lfu, fifo, mru, filo, priority, resight",
    )
    _add_name_options(p)
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
    _add_events_options(p.add_argument_group("KV events and metrics (off by default)"))
    p.set_defaults(func=cmd_serve, parser=p)


def _add_events_options(e: argparse._ArgumentGroup) -> None:
    e.add_argument(
        "--events-endpoint",
        default=None,
        help="publish KV events on this ZMQ endpoint (e.g. tcp://127.0.0.1:5557; a network "
        "address needs --events-curve-secret-file or --events-insecure)",
    )
    e.add_argument(
        "--events-replay-endpoint",
        default=None,
        help="ROUTER endpoint for replay and snapshots (e.g. tcp://127.0.0.1:5558)",
    )
    # The defaults of the options below are None, so that one given without the option
    # it needs can be told apart (``_alone``); ``_serve_config`` puts these in its place.
    e.add_argument(
        "--events-topic", default=None, help="topic of every event message (default empty)"
    )
    e.add_argument(
        "--events-buffer",
        type=positive_arg,
        default=None,
        help=f"batches kept for replay (default {_EVENTS_BUFFER:,})",
    )
    e.add_argument(
        "--events-encoding",
        choices=("map", "array"),
        default=None,
        help="events as maps (default) or as arrays, the form vLLM's subscriber decodes",
    )
    e.add_argument(
        "--events-curve-secret-file",
        default=None,
        metavar="PATH",
        help="CURVE secret key of the events sockets (from `tpcache keys`); needed on a "
        "network address, since events carry token ids",
    )
    e.add_argument(
        "--events-curve-client-keys-file",
        default=None,
        metavar="PATH",
        help="CURVE public keys (one a line) of the subscribers let in; default: any that "
        "knows the server's public key",
    )
    e.add_argument(
        "--events-insecure",
        action="store_true",
        help="allow events on a network address without CURVE (anyone who reaches the "
        "port reads token ids)",
    )
    e.add_argument(
        "--metrics-port",
        type=port_arg,
        default=None,
        help="serve Prometheus metrics on this port (/metrics)",
    )
    e.add_argument(
        "--metrics-host",
        default=None,
        help=f"address the metrics endpoint binds (default {_METRICS_HOST}, loopback; 0.0.0.0 "
        "for all)",
    )


def add_stop_parser(sub) -> None:
    p = sub.add_parser("stop", help="stop a served coordinator (e.g. a detached one)")
    _add_name_options(p)
    p.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster it serves on (default: $RAY_ADDRESS if set, else the cluster "
        "`ray start` made on this machine)",
    )
    p.set_defaults(func=cmd_stop, parser=p)


def add_keys_parser(sub) -> None:
    p = sub.add_parser(
        "keys", help="make a CURVE key pair: the secret into a new file, the public on stdout"
    )
    p.add_argument("secret_file", help="file to create (mode 0600) for the secret key")
    p.set_defaults(func=cmd_keys)


def _add_name_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--name",
        type=name_arg,
        default="tpcache",
        help="the coordinator's Ray actor name, which frontends connect to (default tpcache)",
    )
    p.add_argument(
        "--namespace",
        type=name_arg,
        default="tpcache",
        help="the Ray namespace of that name (default tpcache)",
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from tpcache.cache.errors import CacheError
    from tpcache.coordinator.cluster import ClusterJoinError, join
    from tpcache.errors import TpcacheError
    from tpcache.events.event_config import EventConfigError
    from tpcache.events.metrics import MetricsError
    from tpcache.events.publisher import EventPublisherError
    from tpcache.frontend.service import AlreadyServing, find_served, serve, stop_served

    if (alone := _alone(args)) is not None:
        print(f"tpcache serve: {alone}", file=sys.stderr)
        return 2
    try:
        config = _serve_config(args)
    except (ValueError, CacheError) as exc:  # EventConfigError is one; an unknown policy
        args.parser.error(str(exc))
    except OSError as exc:  # a key file
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    if args.detached and not (args.address or os.environ.get("RAY_ADDRESS")):
        args.parser.error(
            "--detached needs --address: a cluster this command starts ends with it (start "
            "one with `ray start --head`)"
        )
    try:
        joined = join(args.address, args.namespace)
    except ClusterJoinError as exc:
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    # After join: ray.init puts its own SIGTERM handler in, which exits mid-call.
    signal.signal(signal.SIGTERM, _interrupt)
    where = f"--name {args.name} --namespace {args.namespace} --address {joined.address}"
    try:
        actor = serve(config, args.name, args.namespace, args.detached, replace=args.replace)
    except AlreadyServing as exc:
        print(
            f"tpcache serve: {exc}.\n  Stop it with `tpcache stop {where}`, or add --replace "
            "to stop it and serve this one.",
            file=sys.stderr,
        )
        return 1
    except (MetricsError, EventConfigError, EventPublisherError) as exc:
        print(f"tpcache serve: {exc}", file=sys.stderr)
        return 2
    except TpcacheError as exc:  # a rank refused the group, or Ray could not place it
        print(
            f"tpcache serve: the group did not start: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 130
    _print_serving(args, actor, joined.address, joined.started)
    if args.detached:
        print(f"  detached: it keeps serving after this command exits; `tpcache stop {where}`")
        return 0
    print(f"  Ctrl-C or SIGTERM here (or `tpcache stop {where}`) stops it", flush=True)
    try:
        while find_served(args.name, args.namespace) is not None:
            time.sleep(2.0)
        print(f"tpcache serve: {args.name!r} was stopped elsewhere", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time
        print(f"tpcache serve: stopping {args.name!r}", file=sys.stderr, flush=True)
        stop_served(actor, args.name, args.namespace)
    return 0


def _print_serving(args: argparse.Namespace, actor, address: str, started: bool) -> None:
    """Where the served coordinator is, and its events and metrics endpoints."""
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
    if args.events_endpoint:
        print(
            f"  KV events on {args.events_endpoint} (replay: {args.events_replay_endpoint}); "
            f"read them with `tpcache events --endpoint {args.events_endpoint}`"
        )
    if args.metrics_port is not None:
        import ray

        port = ray.get(actor.stats.remote())["metrics_port"]
        print(f"  Prometheus metrics on http://{_metrics_host(args)}:{port}/metrics")


def _serve_config(args: argparse.Namespace):  # -> GroupConfig
    import dataclasses

    from tpcache.events.event_config import EventConfig

    config = group_config(args, args.capacity)
    if args.events_endpoint:
        events = EventConfig(
            **picked(args, "endpoint", "replay_endpoint", "insecure", prefix="events_"),
            topic="" if args.events_topic is None else args.events_topic,
            encoding=args.events_encoding or "map",
            buffer_steps=args.events_buffer or _EVENTS_BUFFER,
            curve_secret_key=_read_key(args.events_curve_secret_file),
            curve_client_keys=_read_keys(args.events_curve_client_keys_file),
        )
        config = dataclasses.replace(config, events=events)
    if args.metrics_port is not None:
        config = dataclasses.replace(
            config, metrics_port=args.metrics_port, metrics_host=_metrics_host(args)
        )
    return config


def _metrics_host(args: argparse.Namespace) -> str:
    return _METRICS_HOST if args.metrics_host is None else args.metrics_host


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


def cmd_keys(args: argparse.Namespace) -> int:
    from tpcache.transport.netsec import new_keypair

    public, secret = new_keypair()
    path = args.secret_file
    try:
        # O_EXCL: a key already there may be in use; it is never written over.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        what = "a directory" if os.path.isdir(path) else "a secret key is never written over"
        return _keys_fail(f"{path} exists already ({what}): name a new file")
    except OSError as exc:  # no such directory, not allowed there, a read-only disk, ...
        where = os.path.dirname(path)
        if isinstance(exc, FileNotFoundError) and where and not os.path.isdir(where):
            return _keys_fail(f"no directory {where} to create {path} in")
        return _keys_fail(f"cannot create {path!r}: {exc.strerror or exc}")
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    print(public)
    return 0


def _keys_fail(message: str) -> int:
    print(f"tpcache keys: {message}", file=sys.stderr)
    return 2
