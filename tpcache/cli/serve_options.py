"""The options of ``tpcache serve`` and ``tpcache stop``, and the group config they make:
what the command line says, apart from running it (``serve.py``)."""

from __future__ import annotations

import argparse

from tpcache.cli.args import group_config, name_arg, picked, port_arg, positive_arg
from tpcache.cli.key_files import read_key, read_keys

EVENTS_BUFFER = 10_000
DEFAULT_CAPACITY = 1 << 20  # KV slots per rank of a group without a model
METRICS_HOST = "127.0.0.1"
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


def unpaired(args: argparse.Namespace) -> str | None:
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


def add_events_options(e: argparse._ArgumentGroup) -> None:
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
    # it needs can be told apart (``unpaired``); ``serve_config`` puts these in its place.
    e.add_argument(
        "--events-topic", default=None, help="topic of every event message (default empty)"
    )
    e.add_argument(
        "--events-buffer",
        type=positive_arg,
        default=None,
        help=f"batches kept for replay (default {EVENTS_BUFFER:,})",
    )
    e.add_argument(
        "--events-encoding",
        choices=("map", "array"),
        default=None,
        help="how events are encoded: map (default), as vLLM after v0.23 sends them; or "
        "array, as vLLM up to v0.23 did, for routers built against it",
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
        help=f"address the metrics endpoint binds (default {METRICS_HOST}, loopback; 0.0.0.0 "
        "for all)",
    )


def add_name_options(p: argparse.ArgumentParser) -> None:
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


def serve_config(args: argparse.Namespace):  # -> (GroupConfig, ServeOptions)
    """The group's config and what it serves beside its cache calls. Raises ValueError
    (``ServeModelError``, ``EventConfigError``, ``FrontendConfigError``, a runner's
    ``RunnerConfigError``) naming what is wrong, ``OSError`` for a key file."""
    import dataclasses

    from tpcache.cli.serve_model import model_group, serve_options
    from tpcache.events.event_config import EventConfig

    with_model = args.model is not None or args.runner is not None
    capacity = args.capacity if with_model or args.capacity is not None else DEFAULT_CAPACITY
    config = group_config(args, capacity)
    found: dict = {}
    if with_model:
        config, found = model_group(args, config)
    if args.events_endpoint:
        events = EventConfig(
            **picked(args, "endpoint", "replay_endpoint", "insecure", prefix="events_"),
            topic="" if args.events_topic is None else args.events_topic,
            encoding=args.events_encoding or "map",
            buffer_steps=args.events_buffer or EVENTS_BUFFER,
            curve_secret_key=read_key(args.events_curve_secret_file),
            curve_client_keys=read_keys(args.events_curve_client_keys_file),
        )
        config = dataclasses.replace(config, events=events)
    if args.metrics_port is not None:
        config = dataclasses.replace(
            config, metrics_port=args.metrics_port, metrics_host=metrics_host(args)
        )
    return config, serve_options(args, found)


def metrics_host(args: argparse.Namespace) -> str:
    return METRICS_HOST if args.metrics_host is None else args.metrics_host
