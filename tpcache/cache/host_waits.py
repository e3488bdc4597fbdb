"""Which running requests' forwards wait for copies of the host tier, and for how many:
the readiness half of ``HostCache``'s copy contract (``host_cache.py``'s docstring).

A request waits only for the copies that touch its own row's device pages (``record``):
a load into them (its own, or one of a prefix it matched while another request's load
of it was not done), or a write-back or write-through copy that still reads a page the
row was just given (a page an eviction freed at once). Copies run in id order, so
waiting for the last such copy waits for all of them. ``done(n)`` moves the known-done
count of the copy log and lets go of the requests it covers. Owned by one ``HostCache``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.errors import HostTierError, IntegrityError
from tpcache.cache.host_tree import CopyLog


class CopyWaits:
    """Per running request, the copy count its forward waits for (absent: none); over the
    cache's ``copies`` log. Owned here: ``waits``."""

    def __init__(self, copies: CopyLog) -> None:
        self.copies = copies
        self.waits: dict[Any, int] = {}

    def record(self, rid: Any, pages: np.ndarray) -> int:
        """``rid``'s row is ``pages`` now: it also waits for the copies not done that
        touch them; returns what it waits for (0: nothing)."""
        last = self.copies.pending_on(pages)
        if last > self.waits.get(rid, 0):
            self.waits[rid] = last
        return self.waits.get(rid, 0)

    def forget(self, rid: Any) -> None:
        self.waits.pop(rid, None)

    def done(self, n: int) -> None:
        """The first ``n`` copies are done. Raises ``HostTierError`` (nothing changed)
        unless ``n`` is an int in ``[0, started]``; at or below the known count it changes
        nothing."""
        c = self.copies
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= c.started:
            raise HostTierError(f"copies_done({n!r}): {c.started} copies were started")
        if n > c.completed:
            c.done(n)
            self.waits = {r: k for r, k in self.waits.items() if k > n}

    def check(self, running: Any) -> None:
        """Raise ``IntegrityError`` unless every waiting request is ``running`` and waits
        for copies that were started and are not known done."""
        c = self.copies
        for rid, k in self.waits.items():
            if rid not in running or not c.completed < k <= c.started:
                raise IntegrityError(
                    f"request {rid!r} waits for {k} copies ({c.started} started, "
                    f"{c.completed} done, running: {rid in running})"
                )
