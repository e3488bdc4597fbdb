"""Answering a request sent again (a client that timed out and resends) instead of
applying it twice: the replies to the last requests applied, by who sent each, its id
and its body."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from tpcache.frontend.owners import Owner


def request_key(owner: Owner, request_id: bytes, body: bytes) -> bytes:
    """Who sent it, its id, and a hash of its body: a client that reuses an id for
    another request gets that request applied, not the old reply."""
    h = hashlib.blake2b(body, digest_size=16).digest()
    return len(owner.key).to_bytes(2, "big") + owner.key + request_id + h


class RecentReplies:
    """The replies to the last requests applied, by ``request_key``: a request sent
    again gets its reply again instead of being applied twice. Bounded in count and in
    bytes; the oldest go first."""

    LIMIT = 4096
    LIMIT_BYTES = 64 << 20

    def __init__(self) -> None:
        self._by_key: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    def keep(self, key: bytes, body: bytes) -> None:
        old = self._by_key.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._by_key[key] = body
        self._bytes += len(body)
        while len(self._by_key) > self.LIMIT or self._bytes > self.LIMIT_BYTES:
            _, gone = self._by_key.popitem(last=False)
            self._bytes -= len(gone)

    def get(self, key: bytes) -> bytes | None:
        return self._by_key.get(key)


__all__ = ["RecentReplies", "request_key"]
