"""Eviction orders: which unlocked leaf goes first.

Every key is a tuple ending in the node id, so the order is total and the same in
every process. Ticks come from the cache's logical clock (advanced by its ops), never
from wall time.

- ``lru``: least recently accessed first. ``mru``: most recently accessed first.
- ``fifo``: oldest inserted first. ``filo``: newest inserted first.
- ``lfu``: fewest hits first (a hit is a match that used the node), ties by recency.
- ``priority``: lowest request priority first (a node keeps the highest priority of the
  requests that inserted or matched it), ties by recency.

Stateful policies (``CACHE_POLICIES`` beyond ``POLICIES``) also keep their own state,
which the tree updates through ``PolicyHooks``; only ``RadixCache`` offers them:
- ``resight``: pages seen before live longer than first-seen ones, by lifetimes learned
  from measured reuse gaps (``policy_resight``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tpcache.cache.errors import CacheError, UnknownName
from tpcache.cache.policy.resight import NAME as RESIGHT
from tpcache.cache.policy.resight import InvalidPolicyParams, ResightParams, ResightPolicy


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
        raise UnknownName(
            f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None


class PolicyHooks(Protocol):
    """What a tree tells a stateful policy (see ``ResightPolicy`` for the contract)."""

    def attach(self, tree: Any) -> None: ...
    def on_match(self, path: list[Any], tick: int) -> None: ...
    def on_insert(self, node: Any) -> Any: ...
    def on_evict(self, nodes: list[Any]) -> None: ...
    def reset(self) -> None: ...
    def check_integrity(self) -> None: ...


CACHE_POLICIES = (*POLICIES, RESIGHT)
_PARAMS: dict[str, type] = {RESIGHT: ResightParams}


def check_policy_params(name: str, params: object) -> None:
    """Raise ``InvalidPolicyParams`` unless ``params`` is ``None`` or the parameter record
    of policy ``name`` (``ResightParams`` for ``resight``; the others take none)."""
    if params is None:
        return
    want = _PARAMS.get(name)
    if want is None or not isinstance(params, want):
        raise InvalidPolicyParams(
            f"policy {name!r} takes {want.__name__ if want else 'no parameters'},"
            f" got {type(params).__name__}"
        )


def make_policy(
    name: str, capacity_pages: int, params: object = None
) -> tuple[KeyFn, PolicyHooks | None]:
    """The key and, for a stateful policy, fresh hooks for one tree of ``capacity_pages``.

    Raises ``CacheError`` for an unknown name, ``InvalidPolicyParams`` for parameters
    that do not belong to it."""
    if name not in CACHE_POLICIES:
        raise CacheError(f"unknown policy {name!r}; known: {', '.join(CACHE_POLICIES)}")
    check_policy_params(name, params)
    if name == RESIGHT:
        # ``params`` is a ResightParams or None now (``check_policy_params``).
        policy = ResightPolicy(
            capacity_pages, params if isinstance(params, ResightParams) else None
        )
        return policy.key, policy
    return POLICY_KEYS[name], None
