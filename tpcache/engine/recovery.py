"""Waiting for a failed TP group to come back, on the engine's side: the coordinator
rebuilds the group (``coordinator.recovery``); the engine only polls its health, with
back-off, without holding the coordinator's lock in between."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tpcache.coordinator.core import Coordinator
from tpcache.errors import TpcacheError
from tpcache.logs import one_line

logger = logging.getLogger("tpcache.engine")


class GroupDown(TpcacheError, RuntimeError):
    """The TP group did not come back: its recovery was stopped, it needs one by hand, it
    took longer than the engine waits, or the engine was closed meanwhile."""

    retryable = True


def wait_healthy(
    coord: Coordinator, wait_s: float, closed: Callable[[], bool], poll_s: float = 0.05
) -> None:
    """Return once a health check of every rank passes (a check that finds a dead or hung
    rank starts the coordinator's recovery; calls are refused while it runs). Polls with
    back-off from ``poll_s`` to 1 s. Raises ``GroupDown`` after ``wait_s``, once the
    recovery is stopped or left to the operator, or when ``closed()`` says so."""
    started = time.monotonic()
    deadline = started + wait_s
    last: BaseException | None = None
    logger.debug("a step failed: the engine waits for its TP group (at most %g s)", wait_s)
    while True:
        if closed():
            raise GroupDown("the engine was closed while its TP group was down")
        try:
            if coord.check_health():
                if last is not None:  # it was down: say when the engine goes on
                    took = time.monotonic() - started
                    logger.info("the engine goes on: its TP group is back after %.1f s", took)
                return
        except TpcacheError as exc:  # refused while recovering, or the failure it found
            last = exc
        down = coord.broken is not None and not coord.recovering
        if down and (coord.recovery.stopped or not coord.config.auto_recover):
            raise _gave_up(f"the TP group is down and its recovery was stopped ({last})")
        if time.monotonic() >= deadline:
            raise _gave_up(f"the TP group did not come back within {wait_s:g} s ({last})")
        time.sleep(poll_s)
        poll_s = min(1.0, poll_s * 2)


def _gave_up(why: str) -> GroupDown:
    """``GroupDown`` for ``why``, told to the operator: the engine's live requests fail."""
    logger.error("the engine gives up on its TP group, its live requests fail: %s", one_line(why))
    return GroupDown(why)


__all__ = ["GroupDown", "wait_healthy"]
