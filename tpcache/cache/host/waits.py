"""Which running requests' forwards wait for copies of the host tier, and for how many:
the readiness half of ``HostCache``'s copy contract (``host_cache.py``'s docstring).

A request waits only for copies that touch its own row's device pages (``record``), in
two ways. A load into them (its own, or one of a prefix it matched while another
request's load of it was not done) must be done on every rank before its forward reads
them: ``waits``, cleared by the agreed count (``done(n)``). A write-back or write-through
copy that still reads a page the row was just given (a page an eviction freed at once)
must be done before the forward writes that page, but only on the rank that runs both:
each rank's copies and forward touch its own shard alone, so its forward waits for its
own copy engine (``local``, ``workers/copysync.py``) and nobody waits for an agreement.
Copies run in id order, so waiting for the last such copy waits for all of them. Owned
by one ``HostCache``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.errors import HostTierError, IntegrityError
from tpcache.cache.host.copylog import CopyLog


class CopyWaits:
    """Per running request, the copy counts its forward waits for (absent: none) on
    every rank (``waits``) and on each rank's own engine (``local``); over the cache's
    ``copies`` log. Owned here: ``waits``, ``local``."""

    def __init__(self, copies: CopyLog) -> None:
        self.copies = copies
        self.waits: dict[Any, int] = {}
        self.local: dict[Any, int] = {}

    def record(self, rid: Any, pages: np.ndarray) -> int:
        """``rid``'s row is ``pages`` now: it also waits for the copies not done that
        touch them; returns what it waits for on every rank (0: nothing)."""
        for table, loads in ((self.waits, True), (self.local, False)):
            last = self.copies.pending_on(pages, loads)
            if last > table.get(rid, 0):
                table[rid] = last
        return self.waits.get(rid, 0)

    def forget(self, rid: Any) -> None:
        self.waits.pop(rid, None)
        self.local.pop(rid, None)

    def done(self, n: int) -> None:
        """The first ``n`` copies are done. Raises ``HostTierError`` (nothing changed)
        unless ``n`` is an int in ``[0, started]``; at or below the known count it changes
        nothing."""
        c = self.copies
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= c.started:
            raise HostTierError(f"copies_done({n!r}): {c.started} copies were started")
        if n > c.completed:
            c.completed = n
            self.waits = {r: k for r, k in self.waits.items() if k > n}
            self.local = {r: k for r, k in self.local.items() if k > n}

    def check(self, running: Any) -> None:
        """Raise ``IntegrityError`` unless every waiting request is ``running`` and waits
        for copies that were started and are not known done."""
        c = self.copies
        for rid, k in [*self.waits.items(), *self.local.items()]:
            if rid not in running or not c.completed < k <= c.started:
                raise IntegrityError(
                    f"request {rid!r} waits for {k} copies ({c.started} started, "
                    f"{c.completed} done, running: {rid in running})"
                )
