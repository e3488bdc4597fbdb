"""``tpcache events``: print a coordinator's KV-event stream, from a snapshot or a replay
if asked (``events/subscriber.py`` does the reading)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TextIO

import msgspec

from tpcache.cache.events import KVEventBatch
from tpcache.events.subscriber import EventSubscriber, EventSubscriberError, Received

__all__ = ["CONNECT_TIMEOUT", "build_events_parser", "run_events"]


# Seconds ``tpcache events`` waits for a publisher's handshake: a loopback or LAN
# connect takes milliseconds, and a wrong endpoint should not look like a quiet one.
CONNECT_TIMEOUT = 5.0


def build_events_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``tpcache events`` options to ``p``."""
    p.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5557",
        help="the coordinator's KV-event PUB endpoint (its `serve --events-endpoint`) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--replay-endpoint",
        default=None,
        help="its ROUTER endpoint for replay and snapshots (`serve --events-replay-endpoint`)",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to")
    p.add_argument("--from-seq", type=int, default=None, metavar="N", help="replay from N")
    p.add_argument("--snapshot", action="store_true", help="start from a snapshot")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N batches")
    p.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop after S s without a batch"
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        metavar="S",
        help="give up (exit 2) if no publisher answers at --endpoint within S s "
        f"(default {CONNECT_TIMEOUT:g})",
    )
    p.add_argument(
        "--replay-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="wait up to S s per message of a replay or snapshot reply",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument(
        "--curve-server-key",
        default=None,
        metavar="KEY",
        help="the publisher's CURVE public key (Z85), when it publishes on a network address",
    )


def _print_batch(seq: int, batch: KVEventBatch, as_json: bool, out: TextIO) -> None:
    if as_json:
        for event in batch.events:
            record = {"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank}
            record.update(msgspec.to_builtins(event))
            out.write(json.dumps(record) + "\n")
    else:
        counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        for event in batch.events:
            counts[type(event).__name__] += 1
        described = " ".join(f"{name}={n}" for name, n in counts.items())
        out.write(f"seq={seq} ts={batch.ts:.6f} {described}\n")
    out.flush()


def _say_where(args: argparse.Namespace) -> None:
    """What ``run_events`` reads from, on stderr (stdout is the events')."""
    more = f", replay from {args.replay_endpoint}" if args.replay_endpoint else ""
    topic = f" (topic prefix {args.topic!r})" if args.topic else ""
    stop = f"; stops after {args.timeout:g} s without a batch" if args.timeout else ""
    print(
        f"tpcache events: reading KV events from {args.endpoint}{topic}{more}{stop}",
        file=sys.stderr,
        flush=True,
    )


def run_events(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the stream. 0: done (``--count`` reached, or idle ``--timeout`` after some
    batches, without ``--count``); 1: ``--timeout`` before ``--count`` batches, or before
    any (said on stderr); 2: bad options or an error, such as no publisher answering at
    ``--endpoint`` within ``--connect-timeout``."""
    out = out if out is not None else sys.stdout
    if (args.from_seq is not None or args.snapshot) and args.replay_endpoint is None:
        print("tpcache events: --from-seq/--snapshot need --replay-endpoint", file=sys.stderr)
        return 2
    if args.from_seq is not None and args.snapshot:
        print("tpcache events: use --from-seq or --snapshot, not both", file=sys.stderr)
        return 2
    if not 0 < args.connect_timeout < math.inf:
        print(
            f"tpcache events: --connect-timeout must be > 0 s, got {args.connect_timeout:g}",
            file=sys.stderr,
        )
        return 2
    shown = 0
    try:
        with EventSubscriber(
            args.endpoint,
            args.replay_endpoint,
            args.topic,
            replay_timeout=args.replay_timeout,
            curve_server_key=args.curve_server_key,
            connect_timeout=args.connect_timeout,
        ) as sub:
            _say_where(args)
            first: list[Received] = []
            if args.snapshot:
                first.append(sub.request_snapshot(args.replay_timeout))
            if args.from_seq is not None:
                first.extend(sub.request_replay(args.from_seq, args.replay_timeout))
            for seq, batch in first:
                if args.count is not None and shown >= args.count:
                    return 0
                _print_batch(seq, batch, args.json, out)
                shown += 1
            while args.count is None or shown < args.count:
                got = sub.next_batch(args.timeout)
                if got is None and shown == 0:
                    print(
                        f"tpcache events: no KV events from {args.endpoint} in "
                        f"{args.timeout:g} s (a publisher answered)",
                        file=sys.stderr,
                    )
                    return 1
                if got is None:
                    return 0 if args.count is None else 1
                _print_batch(*got, args.json, out)
                shown += 1
    except EventSubscriberError as exc:
        print(f"tpcache events: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
