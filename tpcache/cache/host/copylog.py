"""The host tier's copy log (``CopyLog``): every copy between the tiers, numbered in the
order it starts, and which device pages each pending one touches."""

from __future__ import annotations

import numpy as np

from tpcache.cache.host.config import HostCopy


class CopyLog:
    """The copies a cache started, numbered from 0. Counters always; the records only
    when ``keep`` (a rank runs them; a replay has no use for them). ``defer``: the
    completed prefix moves only by ``CopyWaits.done`` (else every copy completes as it
    starts); then, per device page, ``touch`` keeps 1 + the id of the last copy started that
    reads or writes it and ``loads`` of the last load that writes it (0: none), so a
    request waits only for the copies of its own pages (``host_waits.py``)."""

    def __init__(self, keep: bool, defer: bool = False, device_pages: int = 0) -> None:
        self.keep = keep
        self.started = 0  # copies started (ids 0 .. started - 1)
        self.completed = 0  # their completed prefix (agreed, in a lockstep)
        self.records: list[HostCopy] = []  # owned here; taken by ``take``
        # Owned here: written as copies start, read by ``pending_on``.
        self.touch = np.zeros(device_pages, np.int64) if defer else None
        self.loads = np.zeros(device_pages, np.int64) if defer else None
        # Nothing per copy is kept (a replay): ``started_many`` may count copies at once.
        self.counts_only = not keep and not defer

    def start(self, to_host: bool, device: np.ndarray, host: np.ndarray) -> int:
        cid = self.started
        self.started = cid + 1
        touch, loads = self.touch, self.loads  # both arrays, or both None
        if touch is None or loads is None:
            self.completed = cid + 1
        else:
            touch[device] = cid + 1
            if not to_host:
                loads[device] = cid + 1
        if self.keep:
            self.records.append(HostCopy(cid, to_host, device.copy(), host.copy()))
        return cid

    def started_many(self, k: int) -> None:
        """``k`` copies start (``counts_only``): what ``start`` would count, nothing else."""
        self.started += k
        self.completed = self.started

    def pending_on(self, pages: np.ndarray, loads: bool) -> int:
        """1 + the id of the last copy not known done that touches one of the device
        ``pages`` (``loads``: the last load that writes one); 0 if none. Pure."""
        table = self.loads if loads else self.touch
        if table is None or self.started == self.completed or not pages.size:
            return 0
        last = int(table[pages].max())
        return last if last > self.completed else 0

    def take(self) -> list[HostCopy]:
        out, self.records = self.records, []
        return out
