"""What the coordinator saw of a Ray rank, in words for the log: why a recovery replaces
it, and where it runs (its actor and node), so an operator can find its process and its
Ray log."""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray.exceptions import RayActorError

from tpcache.logs import one_line


def why_replace(rank: int, ref: Any, answered: bool, unfit: bool, probe_s: float) -> str | None:
    """Why ``rank`` must be replaced, from its answer ``ref`` to a health check (``answered``:
    within ``probe_s``; ``unfit``: its join of the last group failed or never returned).
    None: it is healthy and kept."""
    if unfit:
        return "its join of the last group failed or never returned"
    if not answered:
        return f"no answer to a health check within {probe_s:g} s"
    try:
        got, busy_s, why_not = ray.get(ref, timeout=0)
    except RayActorError as exc:
        return f"its actor is dead ({one_line(exc, 200)})"
    except Exception as exc:
        return f"its health check failed: {type(exc).__name__}: {one_line(exc, 200)}"
    if got != rank:
        return f"it answered as rank {got}"
    if busy_s >= probe_s:
        return f"busy with one message for {busy_s:.1f} s (hung in a step)"
    if why_not is not None:
        # A join in hand, or this process's own word that its torch.distributed state
        # cannot form a group again (a failed join).
        return str(why_not)
    return None


def actor_id(actor: Any) -> str:
    """A Ray actor's id, as `ray list actors` and `ray logs actor --id` take it ("?" if
    unknown). Ray's handle has no public accessor for it."""
    return str(getattr(getattr(actor, "_actor_id", None), "hex", lambda: "?")())


def node_address(node_id: str) -> str:
    """A Ray node's address (its id where the cluster cannot say)."""
    with contextlib.suppress(Exception):
        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                return str(n.get("NodeManagerAddress") or node_id)
    return node_id
