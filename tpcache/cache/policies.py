"""Eviction orders: which unlocked leaf goes first.

Every key is a tuple ending in the node id, so the order is total and the same in
every process. Ticks come from the cache's logical clock (advanced by its ops), never
from wall time.

- ``lru``: least recently accessed first. ``mru``: most recently accessed first.
- ``fifo``: oldest inserted first. ``filo``: newest inserted first.
- ``lfu``: fewest hits first (a hit is a match that used the node), ties by recency.
- ``priority``: lowest request priority first (a node keeps the highest priority of the
  requests that inserted or matched it), ties by recency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class PolicyNode(Protocol):
    id: int
    last_access: int
    created: int
    hits: int
    priority: int


KeyFn = Callable[[PolicyNode], tuple[int, ...]]


def _lru(n: PolicyNode) -> tuple[int, ...]:
    return (n.last_access, n.id)


def _mru(n: PolicyNode) -> tuple[int, ...]:
    return (-n.last_access, n.id)


def _fifo(n: PolicyNode) -> tuple[int, ...]:
    return (n.created, n.id)


def _filo(n: PolicyNode) -> tuple[int, ...]:
    return (-n.created, n.id)


def _lfu(n: PolicyNode) -> tuple[int, ...]:
    return (n.hits, n.last_access, n.id)


def _priority(n: PolicyNode) -> tuple[int, ...]:
    return (n.priority, n.last_access, n.id)


POLICY_KEYS: dict[str, KeyFn] = {
    "lru": _lru,
    "lfu": _lfu,
    "fifo": _fifo,
    "mru": _mru,
    "filo": _filo,
    "priority": _priority,
}
POLICIES = tuple(POLICY_KEYS)


def policy_key(name: str) -> KeyFn:
    """The eviction key of policy ``name``; raises ``ValueError`` naming the known ones."""
    try:
        return POLICY_KEYS[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None
