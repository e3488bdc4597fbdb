"""The ``tpcache`` command line. Each subcommand imports what it needs when it runs, so
``tpcache replay`` never pays for Ray or torch.

    replay   the cache state machine alone, over a trace        (replay.py)
    demo     a TP group of Ray actors driven with a trace        (demo.py)
    serve    a TP group's coordinator as a named Ray actor       (serve.py)
    stop     stop a served coordinator                           (serve.py)
    keys     a CURVE key pair for the events sockets             (serve.py)
    events   subscribe to a coordinator's KV events              (events/subscriber.py)

Argument types and the options several commands share are in ``args.py``.
"""

from __future__ import annotations

import argparse
import sys

from tpcache.cli.args import add_trace_options, machine, seconds_arg
from tpcache.cli.demo import add_demo_parser
from tpcache.cli.replay import add_replay_parser
from tpcache.cli.serve import add_keys_parser, add_serve_parser, add_stop_parser

__all__ = ["add_trace_options", "build_parser", "machine", "main", "seconds_arg"]


def _cmd_events(args: argparse.Namespace) -> int:
    from tpcache.events.subscriber import run_events

    return run_events(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpcache", description="One prefix KV cache for a tensor-parallel group."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(sub)
    add_demo_parser(sub)
    add_serve_parser(sub)
    add_stop_parser(sub)
    add_keys_parser(sub)

    from tpcache.events.subscriber import build_events_parser

    p = sub.add_parser(
        "events",
        help="subscribe to a coordinator's KV events and print them",
        description="Print the KV events a coordinator publishes (`tpcache serve "
        "--events-endpoint ...`): one line per batch, or one JSON object per event with "
        "--json. With no options it reads tcp://127.0.0.1:5557 until Ctrl-C.",
    )
    build_events_parser(p)
    p.set_defaults(func=_cmd_events)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
