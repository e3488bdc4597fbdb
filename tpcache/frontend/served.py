"""Finding, describing and stopping a coordinator served as a named Ray actor
(``service.serve``); ``service`` re-exports each."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray


def find_served(name: str, namespace: str) -> Any | None:
    """The actor served as ``name`` in ``namespace``, or None."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def describe(actor: Any, timeout_s: float = 10.0) -> str:
    """One line on a served coordinator: its group, or that it does not answer."""
    try:
        st = ray.get(actor.stats.remote(), timeout=timeout_s)
    except Exception as exc:
        return f"not answering within {timeout_s:g} s: {type(exc).__name__}"
    return (
        f"TP={st['tp']}, capacity {st['capacity']:,} tokens, {st['running']} running "
        f"requests, {st['steps_done']:,} steps done"
    )


def stop_served(actor: Any, name: str, namespace: str, timeout_s: float = 60.0) -> None:
    """Shut a served coordinator down (ranks, endpoints), end its actor for good, and wait
    until its name is free. A coordinator that does not answer is killed anyway."""
    with contextlib.suppress(Exception):
        ray.get(actor.shutdown.remote(), timeout=timeout_s)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while find_served(name, namespace) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
