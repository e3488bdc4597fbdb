"""``LostRequests``: which request ids the TP group lost, and why, so that a later call
for one raises ``RequestLost`` (retry it as a new request) instead of ``UnknownRequest``.

A request is lost when it was running as the group failed or recovered, or, after a
restarted service (``restart_note``), any id the coordinator does not know. The memory
is bounded: at most ``LIMIT`` ids, the oldest forgotten first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tpcache.coordinator.errors import RequestLost


class LostRequests:
    """Owned by the ``StepPipeline``: it records what a failure or a recovery lost; the
    coordinator checks each call's id and forgets an id admitted again."""

    LIMIT = 100_000

    def __init__(self) -> None:
        self._why: dict[Any, str] = {}  # id -> why it was lost, oldest first
        # Set by a restarted service: every unknown request id may have been lost.
        self.restart_note: str | None = None

    def lose(self, rids: Iterable[Any], why: str, *, replace: bool = True) -> None:
        """Record ``rids`` as lost for ``why`` (``replace=False`` keeps an earlier why)."""
        for rid in rids:
            if replace or rid not in self._why:
                self._why[rid] = why
        while len(self._why) > self.LIMIT:
            del self._why[next(iter(self._why))]

    def check(self, rid: Any, running: bool) -> None:
        """Raise ``RequestLost`` for ``rid`` if it is not ``running`` and was lost (it is
        then forgotten) or may have been lost to a restart. Changes nothing otherwise."""
        if not _hashable(rid) or running:
            return
        why = self._why.pop(rid, None)
        if why is not None:
            raise RequestLost(f"request {rid!r} was lost ({why}); admit it again")
        if self.restart_note is not None:
            raise RequestLost(
                f"request {rid!r} is unknown: {self.restart_note}, so requests admitted "
                "before then are lost; admit it again"
            )

    def forget(self, rid: Any) -> None:
        """A request admitted again is no longer lost."""
        if _hashable(rid):
            self._why.pop(rid, None)


def _hashable(rid: Any) -> bool:
    return isinstance(rid, int | str)
