"""What the coordinator's request calls return: small frozen records that carry all a
frontend answers with (prefix length, slots, a hybrid cache's SWA slots, a rewritten
row), so that no caller reads the coordinator's mirror, which only a call holding the
coordinator's lock may touch. Built from the mirror inside that call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpcache.cache.host.config import HostAdmitResult
from tpcache.cache.keys import pages_to_slots
from tpcache.cache.protocol import Cache
from tpcache.cache.records import AdmitResult, RequestId


@dataclass(frozen=True, slots=True)
class SwaWindow:
    """The SWA KV a hybrid cache's forward reads and writes: ``slots`` (SWA-pool ids) of
    positions ``start`` .. the request's end, ``start`` being the window before the first
    new token (at least 0)."""

    start: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: its first ``prefix_len`` tokens were cached; ``pages`` (a
    read-only view of its row) hold its prompt and reserve, ``num_tokens`` in all. With a
    host tier, ``host_hit_length`` of the prefix's last tokens are being loaded from the
    host and its forward waits for ``ready_after`` copies (0: none). ``swa``: the SWA
    slots from the first token not cached; None without an SWA pool."""

    prefix_len: int
    pages: np.ndarray
    num_tokens: int
    page_size: int
    host_hit_length: int = 0
    ready_after: int = 0
    swa: SwaWindow | None = None

    @property
    def slots(self) -> np.ndarray:
        """Full-pool slot ids of the ``num_tokens`` tokens (a new array)."""
        return pages_to_slots(self.pages, self.page_size, self.num_tokens)


@dataclass(frozen=True, slots=True)
class Extension:
    """A running request's ``slots`` for its next tokens; ``swa``: the SWA slots from the
    first of them (None without an SWA pool)."""

    slots: np.ndarray
    swa: SwaWindow | None = None


@dataclass(frozen=True, slots=True)
class RowRewrite:
    """A request's row after ``cache_unfinished`` gave it pages the tree already held:
    ``slots``: all its slots now; ``freed``: those it held before that are free now
    (sorted); ``swa``: the SWA slots of its last window (None without an SWA pool)."""

    slots: np.ndarray
    freed: np.ndarray
    swa: SwaWindow | None = None


@dataclass(frozen=True, slots=True)
class Cached:
    """``cache_unfinished``'s outcome: ``cached_len`` tokens of the request are the
    tree's; ``rewrite``: its row if it changed (None when no slot moved)."""

    cached_len: int
    rewrite: RowRewrite | None = None


def swa_window(mirror: Cache, rid: RequestId, start: int) -> SwaWindow | None:
    """The SWA slots for a forward of ``rid`` whose first new token is ``start``; None
    without an SWA pool. Pure."""
    if mirror.swa is None:
        return None
    return SwaWindow(*mirror.swa.request_slots(rid, start))


def admission(mirror: Cache, rid: RequestId, got: AdmitResult) -> Admission:
    """The record of ``rid``'s admission, which gave ``got``. Pure."""
    swa = swa_window(mirror, rid, got.prefix_len)
    host = (got.host_hit_length, got.ready_after) if isinstance(got, HostAdmitResult) else (0, 0)
    return Admission(got.prefix_len, got.pages, got.num_tokens, got.page_size, *host, swa)


def extension(mirror: Cache, rid: RequestId, slots: np.ndarray) -> Extension:
    """The record of ``rid``'s extension by ``slots``. Pure."""
    if mirror.swa is None:
        return Extension(slots)
    start = mirror.request_row(rid).num_tokens - slots.size
    return Extension(slots, swa_window(mirror, rid, start))


def cached(mirror: Cache, rid: RequestId, n: int, before: np.ndarray) -> Cached:
    """The record of ``cache_unfinished`` on ``rid``, which cached ``n`` tokens and found
    the row's pages ``before`` (a copy). Pure."""
    row = mirror.request_row(rid)
    if np.array_equal(before, row.pages):
        return Cached(n)
    ps = mirror.page_size
    freed = before[before != row.pages]
    return Cached(
        n,
        RowRewrite(
            pages_to_slots(row.pages, ps, row.num_tokens),
            pages_to_slots(np.sort(freed), ps),
            swa_window(mirror, rid, row.num_tokens),
        ),
    )
