"""Argument types and the options several commands share. Imports neither Ray nor torch:
the choices below are checked against ``coordinator.build``'s by a test."""

from __future__ import annotations

import argparse
import math
import os
import platform
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tpcache.errors import TpcacheError

if TYPE_CHECKING:
    from tpcache.coordinator.build import GroupConfig

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # = build.STRATEGIES
TRANSPORTS = ("channel", "ray")  # = build.TRANSPORTS

_T = TypeVar("_T")


class ArgumentValueError(TpcacheError, ValueError):
    """A command-line value that does not parse; argparse reports it as an invalid value."""


def _checked(
    text: str, read: Callable[[str], _T], ok: Callable[[_T], bool], unread: str, bad: str
) -> _T:
    """The argparse types' one shape: ``read(text)``, then ``ok`` of the value; an
    ``ArgumentTypeError`` with ``unread`` (if ``read`` raises ValueError) or ``bad`` (if
    ``ok`` fails), both formatted with ``text`` and ``value``."""
    try:
        value = read(text)
    except (ValueError, OverflowError):  # (int(float("1e400")) overflows)
        raise argparse.ArgumentTypeError(unread.format(text=text)) from None
    if not ok(value):
        raise argparse.ArgumentTypeError(bad.format(text=text, value=value))
    return value


def capacity_arg(text: str) -> int | None:
    """argparse type: a token count >= 1, or ``inf`` (None)."""
    if text.lower() in ("inf", "infinite", "none"):
        return None
    return _checked(
        text,
        lambda t: int(float(t)),
        lambda v: v >= 1,
        "capacity must be a token count or 'inf', got {text!r}",
        "capacity must be >= 1 token, got {value}",
    )


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    what = "expected a port from 0 to 65535, got "
    return _checked(text, int, lambda v: 0 <= v <= 65535, what + "{text!r}", what + "{value}")


def name_arg(text: str) -> str:
    """argparse type: a non-empty name (a Ray actor name or namespace)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty name")
    return text


def positive_arg(text: str) -> int:
    """argparse type: an integer >= 1."""
    what = "expected a positive integer, got "
    return _checked(text, int, lambda v: v >= 1, what + "{text!r}", what + "{value}")


def scale_arg(text: str) -> int:
    """argparse type: a scale ``1/K`` (or ``1``) with K a power of two in [1, 512];
    returns K, the divisor of every length (``trace.check_scale``)."""
    t = text.strip()
    k = 1 if t == "1" else int(t[2:]) if t.startswith("1/") and t[2:].isdigit() else 0
    if k not in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        raise argparse.ArgumentTypeError(
            f"expected a scale 1/K with K a power of two from 1 to 512 (so a 512-token block "
            f"stays whole tokens), e.g. 1/32; got {text!r}"
        )
    return k


def add_scale_option(p: argparse.ArgumentParser) -> None:
    """``--scale 1/K``, shared by ``replay`` and ``generate`` so both read the same slice."""
    p.add_argument(
        "--scale",
        type=scale_arg,
        default=1,
        metavar="1/K",
        help="divide every length of the trace by K, rounded up (a 512-token block becomes "
        "512/K tokens; K a power of two up to 512; default 1/1)",
    )


def seconds_arg(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _checked(
        text,
        float,
        lambda v: math.isfinite(v) and v > 0,
        "expected seconds, got {text!r}",
        "expected a finite number of seconds > 0, got {text}",
    )


def gpus_arg(text: str) -> float:
    """argparse type: GPUs per rank, a number in (0, 64]."""
    return _checked(
        text,
        float,
        lambda v: math.isfinite(v) and 0 < v <= 64,
        "expected a number of GPUs, got {text!r}",
        "GPUs per rank must be in (0, 64], got {text}",
    )


def rank_resources_arg(text: str) -> dict[str, float] | list[dict[str, float]]:
    """argparse type: custom Ray resources for the ranks' bundles. ``NAME=AMOUNT`` pairs
    joined by commas are one group; one group is asked by every rank, several groups
    joined by ``;`` are one per rank, in rank order (``node_a=1;node_b=1``)."""
    groups = []
    for part in text.split(";"):
        group: dict[str, float] = {}
        for item in part.split(","):
            name, eq, amount = item.strip().partition("=")
            name = name.strip()
            try:
                value = float(amount)
            except ValueError:
                value = math.nan
            if not eq or not name or not (math.isfinite(value) and value > 0):
                raise argparse.ArgumentTypeError(
                    f"expected NAME=AMOUNT pairs (amount > 0), joined by ',' within a rank and "
                    f"by ';' between ranks, e.g. 'node_a=1;node_b=1'; got {item.strip()!r}"
                )
            if name in ("CPU", "GPU", "memory"):
                raise argparse.ArgumentTypeError(
                    f"{name} is not a custom resource (use --gpus-per-rank for GPUs)"
                )
            group[name] = value
        groups.append(group)
    return groups[0] if len(groups) == 1 else groups


def add_count_option(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, default: int, what: str
) -> None:
    """``flag``: an integer >= 1, ``default`` unless given, which its help names."""
    p.add_argument(flag, type=positive_arg, default=default, help=f"{what} (default {default})")


def add_cache_options(
    p: argparse.ArgumentParser, capacity: int | None, capacity_help: str, policy_help: str
) -> None:
    """``--capacity`` (default ``capacity``), ``--page-size`` and ``--policy``: the cache's
    options, shared by the trace commands and ``serve``."""
    p.add_argument("--capacity", type=capacity_arg, default=capacity, help=capacity_help)
    add_count_option(p, "--page-size", 16, "tokens per page")
    p.add_argument("--policy", default="lru", help=policy_help)


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """The trace options shared by ``replay`` and ``demo``."""
    add_cache_options(
        p, None, "cache size in tokens, or 'inf' (default)", "eviction policy (default lru)"
    )
    p.add_argument(
        "--limit", type=positive_arg, default=None, help="replay only the first N requests"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_host_options(p: argparse.ArgumentParser) -> None:
    """The host (CPU) tier options of ``replay``, ``demo`` and ``serve``."""
    p.add_argument(
        "--host-capacity",
        type=positive_arg,
        default=None,
        help="host tier size in tokens (per rank): evicted or hot pages are kept there and "
        "loaded back",
    )
    p.add_argument(
        "--write-policy",
        choices=("write_back", "write_through_selective"),
        default=None,
        help="what goes to the host: pages evicted from the device (write_back, default), "
        "or nodes hit --write-through-hits times (write_through_selective)",
    )
    p.add_argument(
        "--write-through-hits",
        type=positive_arg,
        default=None,
        help="hits that copy a node to the host under write_through_selective (default 2)",
    )


def host_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the host tier options together, or None."""
    if args.host_capacity is None and (args.write_policy or args.write_through_hits):
        return "--write-policy and --write-through-hits need --host-capacity"
    if args.write_through_hits is not None and args.write_policy != "write_through_selective":
        return "--write-through-hits needs --write-policy write_through_selective"
    return None


def add_tp_option(p: argparse.ArgumentParser) -> None:
    """``--tp``, shared by the group options and ``generate``."""
    add_count_option(p, "--tp", 2, "tensor-parallel ranks")


def add_namespace_options(p: argparse.ArgumentParser, salt_help: str) -> None:
    """``--salt`` (repeatable; ``salt_help`` says what several mean) and ``--lora-id``: the
    cache namespace of the requests (``tpcache.cache.namespace``)."""
    p.add_argument("--salt", action="append", default=[], help=salt_help)
    p.add_argument(
        "--lora-id", type=int, default=None, help="run the requests in this LoRA id's namespace"
    )


def add_group_options(p: argparse.ArgumentParser) -> None:
    """The TP group's options, shared by ``demo`` and ``serve``."""
    add_tp_option(p)
    p.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="Ray cluster to join: the head's address (its `ray start --head --port`), or "
        "auto (the one `ray start` made on this machine); default: $RAY_ADDRESS if set, "
        "else start a local cluster that ends with this command. With Ray's token "
        "authentication the token is read from ~/.ray/auth_token (or RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH)",
    )
    p.add_argument("--layers", type=positive_arg, help="KV-pool layers without a model (default 1)")
    p.add_argument("--head-dim", type=positive_arg, help="KV-pool head dim, no model (default 4)")
    p.add_argument(
        "--timeout",
        type=seconds_arg,
        default=60.0,
        help="collective timeout in seconds: how fast a hung rank is found (default 60); "
        "the coordinator waits max(2 x it, it + 5) seconds for a step's results, which "
        "bounds finding a rank hung with no peer to notice (--tp 1, or every rank hung) "
        "and a frontend's wait for a prefix loaded back from the host tier",
    )
    p.add_argument(
        "--join-timeout",
        type=seconds_arg,
        default=120.0,
        help="seconds ranks wait for each other to join the group, at start-up and after "
        "a rank is replaced (default 120)",
    )
    _add_placement_options(
        p.add_argument_group("placement of the ranks (Ray placement group, one bundle a rank)")
    )


def _add_placement_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="PACK",
        help="PACK (default: as few nodes as fit), SPREAD (across nodes where it can), "
        "STRICT_PACK (one node), STRICT_SPREAD (every rank on a node of its own)",
    )
    g.add_argument(
        "--gpus-per-rank",
        type=gpus_arg,
        default=1.0,
        metavar="F",
        help="GPUs in each rank's bundle when the cluster has GPUs (default 1; a fraction "
        "shares a GPU)",
    )
    g.add_argument(
        "--rank-resources",
        type=rank_resources_arg,
        default=None,
        metavar="SPEC",
        help="custom Ray resources to pin ranks to nodes (given to the nodes with `ray "
        "start --resources`): 'node_a=1' for every rank, or one group per rank joined "
        "by ';', 'node_a=1;node_b=1'; several in a group joined by ','",
    )
    g.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="channel",
        help="how steps reach the ranks: channel (default: ZMQ, IPC on the coordinator's "
        "node, CURVE TCP across nodes) or ray (one Ray actor call per rank per message)",
    )


def group_config(args: argparse.Namespace, capacity: int | None) -> GroupConfig:
    """The ``GroupConfig`` the group and host tier options ask for. Raises ``ValueError``
    naming what does not fit (e.g. 3 resource groups for 2 ranks; ``HostTierError`` is
    one, for a host tier the cache cannot have; ``CoordinatorConfigError`` another, for a
    --timeout too long to derive a step timeout from)."""
    from tpcache.coordinator.build import GroupConfig
    from tpcache.coordinator.step_types import CoordinatorConfig, step_timeout_for
    from tpcache.workers.spec import CacheSpec

    if (err := host_args_error(args)) is not None:
        raise ArgumentValueError(err)
    cache = CacheSpec(
        page_size=args.page_size,
        policy=args.policy,
        host_capacity_tokens=args.host_capacity,
        write_policy=args.write_policy or "write_back",
        write_through_hits=args.write_through_hits or 2,
    )
    # A thin pool (one KV head per rank, 4 dims, fp16) keeps a CPU demo's memory small;
    # the index and the lockstep are what the demo exercises.
    bytes_per_slot = 2 * (args.layers or 1) * (args.head_dim or 4) * 2  # (None: not given)
    budget = (capacity or 1 << 20) * bytes_per_slot + (1 << 20)
    res = args.rank_resources
    if isinstance(res, list) and len(res) != args.tp:
        raise ArgumentValueError(
            f"--rank-resources gives {len(res)} groups for --tp {args.tp}: give one group "
            f"for every rank, or one per rank"
        )
    return GroupConfig(
        tp=args.tp,
        capacity_tokens=capacity,
        cache=cache,
        num_layers=args.layers or 1,
        kv_heads=args.tp,
        head_dim=args.head_dim or 4,
        dtype="float16",
        cpu_budget_bytes=budget,
        timeout_s=args.timeout,
        join_timeout_s=args.join_timeout,
        strategy=args.strategy,
        gpus_per_rank=args.gpus_per_rank,
        rank_resources=res,
        transport=args.transport,
        # --timeout bounds the coordinator's wait for a step too, not only a collective
        # (the margin and why: ``step_timeout_for``).
        coordinator=CoordinatorConfig(step_timeout_s=step_timeout_for(args.timeout, "--timeout")),
    )


def picked(args: argparse.Namespace, *names: str, prefix: str = "") -> dict[str, Any]:
    """``{name: args.<prefix><name>}``: the options a record takes as they were given."""
    return {name: getattr(args, prefix + name) for name in names}


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} cpus, {platform.machine()}, Python {platform.python_version()})"
