"""Who sent a call, and what that scopes: its request ids, its cache salt, its figures.

Several clients share one coordinator (routers, engines, tenants). A request id names a
request of the client that admitted it only: another client's id is unknown to it, as
if it never existed, so no client can learn, extend, finish or abort another's requests.
A client is its ``Owner``: on the network, its credential (a tenant's token, a CURVE
key) and its connection's identity; through Ray, the session id its ``Client`` draws.

The cache sees a scoped id (``scoped_id``): a hash of the owner and the client's id,
so ids cost no table (nothing to leak or to forget) and are equal on every rank. Errors
name the client's own id again (``own_message``).

A cache salt is scoped to the owner's credential (``bound_salt``): a tenant's salt keys
KV only that tenant can match, so guessing another tenant's salt gives nothing.
Clients of one credential (or of none: the loopback default) share salts, as they are
one trust domain.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tpcache.cache.reqtable import check_request_id


@dataclass(frozen=True)
class Owner:
    """A client: ``key`` tells it apart from every other (credential and connection);
    ``credential`` is what it authenticated as ("" for none, or the shared token)."""

    key: bytes
    credential: str = ""


def scoped_id(owner: Owner, request_id: Any) -> str:
    """The id the cache knows ``owner``'s request by. Raises the cache's ``CacheError``
    for a malformed id (as an unscoped call would)."""
    rid = check_request_id(request_id)
    kind = b"i" if isinstance(rid, int) else b"s"
    h = hashlib.blake2b(digest_size=16, person=b"tpcache-rid")
    for part in (owner.key, kind + str(rid).encode("utf-8")):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return "~" + h.hexdigest()


def bound_salt(owner: Owner, salt: str | None) -> str | None:
    """``salt`` as the cache keys it for ``owner``: as given without a credential (and
    ``None`` stays ``None``: the shared default namespace), else bound to it."""
    if salt is None or not owner.credential or not isinstance(salt, str):
        return salt  # a salt of a wrong type is refused by the namespace's own check
    h = hashlib.blake2b(digest_size=16, person=b"tpcache-salt")
    for part in (
        owner.credential.encode("utf-8", "surrogatepass"),
        salt.encode("utf-8", "surrogatepass"),
    ):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return "~" + h.hexdigest()


def own_message(message: str, scoped: str, request_id: Any) -> str:
    """An error's message as the client should read it: its own id where the cache
    named the scoped one."""
    return message.replace(repr(scoped), repr(request_id))


@dataclass
class Figures:
    """One client's own prefix figures since it first called."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class ClientFigures:
    """Per-client figures, for the clients that may see only their own. Bounded: the
    ``limit`` clients heard from most recently are kept. Owned by the frontend that
    serves them (its thread, under the coordinator's lock)."""

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self._by_key: OrderedDict[bytes, Figures] = OrderedDict()

    def admitted(self, owner: Owner, tokens: int, hit: int) -> None:
        f = self._by_key.pop(owner.key, None) or Figures()
        f.queries += 1
        f.query_tokens += tokens
        f.hit_tokens += hit
        self._by_key[owner.key] = f
        while len(self._by_key) > self.limit:
            self._by_key.popitem(last=False)

    def of(self, owner: Owner) -> Figures:
        return self._by_key.get(owner.key) or Figures()


# What a client that may see only its own figures reads of the group: its shape and
# health, nothing that moves with another client's traffic.
GROUP_KEYS = ("tp", "capacity", "broken", "recovering", "rank_paths", "metrics_port")


def client_stats(group: dict[str, Any], own: Figures) -> dict[str, Any]:
    """``stats()`` as a client sees it: the group's shape and health, and its own
    prefix figures (``scope``: ``"client"``)."""
    out: dict[str, Any] = {k: group[k] for k in GROUP_KEYS if k in group}
    out.update(
        scope="client",
        queries=own.queries,
        query_tokens=own.query_tokens,
        hit_tokens=own.hit_tokens,
        hit_rate=own.hit_tokens / own.query_tokens if own.query_tokens else 0.0,
    )
    return out


__all__ = [
    "ClientFigures",
    "Figures",
    "Owner",
    "bound_salt",
    "client_stats",
    "own_message",
    "scoped_id",
]
