"""The coordinator's side of the host tier's agreed copy completion (the protocol:
``workers/copysync.py``).

While its mirror has copies not known done, every step the coordinator closes ends with
a ``CopySync`` op (the ranks agree their done count by MIN there). The count comes back
in each rank's step result; once it exceeds what the mirror knows, the next call, or
the next step closed, first applies it to the mirror (``copies_done``) and logs a
``CopiesDone`` op, so the ranks apply it at the same point of the op log. It is never
applied while a closed step waits for its digest, nor in the middle of a call.
"""

from __future__ import annotations

import time
from typing import Any

from tpcache.cache.protocol import Cache
from tpcache.errors import TpcacheError
from tpcache.lockstep.ops import CopiesDone, CopySync, Op, OpResult, StepResult

_SYNC_WAIT_S = 0.05  # how long ranks wait for a forward's copies before a CopySync agrees


class CopiesNotDone(TpcacheError, TimeoutError):
    """A forward waited longer than its timeout for the copies its requests wait for
    (a rank's copies are slow or stuck). Retryable: nothing changed."""


class CopyCompletion:
    """What the ranks agreed (``agreed``: the highest count a ``CopySync`` returned since
    the group last started; owned here) and the ops that bring it to every rank."""

    def __init__(self) -> None:
        self.agreed = 0

    def restart(self) -> None:
        """The group started over (a fresh copy log on every rank)."""
        self.agreed = 0

    def note(self, results: list[StepResult]) -> int | None:
        """Take one step's results from every rank; the first rank whose agreed count
        differs from rank 0's (a MIN gives every rank the same), else None."""
        counts = [r.copies_done for r in results]
        odd = [r.rank for r in results if r.copies_done != counts[0]]
        if odd:
            return odd[0]
        self.agreed = max(self.agreed, counts[0])
        return None

    def completion(self, mirror: Cache) -> list[tuple[Op, OpResult]]:
        """Apply a newly agreed count to ``mirror``; the ``CopiesDone`` op for the ranks
        (none when the mirror knows it already or has no host tier)."""
        host = mirror.host
        if host is None or not host.copies_pending() or self.agreed <= host.copies_completed():
            return []
        host.copies_done(self.agreed)
        return [(CopiesDone(self.agreed), OpResult())]

    @staticmethod
    def sync_op(mirror: Cache, ops: list[tuple[Op, OpResult]]) -> list[tuple[Op, OpResult]]:
        """The ``CopySync`` that ends a closing step whose mirror has copies pending."""
        if mirror.host is None or not mirror.host.copies_pending():
            return []
        if ops and isinstance(ops[-1][0], CopySync):
            return []
        return [(CopySync(), OpResult())]


def unready(mirror: Cache, rids: list[Any]) -> int:
    """The copy count the first of ``rids`` that may not run its forward yet waits for
    (0: all may). Pure."""
    host = mirror.host
    if host is None:  # nothing to wait for; a request that is not running is still refused
        for rid in rids:
            mirror.request_row(rid)
        return 0
    done = host.copies_completed()
    return next((k for k in map(host.ready_after, rids) if k > done), 0)


def wait_ready(steps: Any, rids: list, timeout: float) -> None:
    """Until every running request of ``rids`` may run its forward (the copies it waits
    for are agreed done, and the ranks know it): steps of one ``CopySync`` go out through
    the pipeline ``steps`` until then. Raises ``CopiesNotDone`` after ``timeout`` seconds,
    or what a failed step raises (a failed copy fails the group)."""
    deadline = time.monotonic() + timeout
    while waits := unready(steps.mirror, rids):
        if time.monotonic() > deadline:
            raise CopiesNotDone(
                f"a request waits for {waits} copies to be done; after {timeout:g}s "
                f"the ranks agree {steps.copies.agreed}"
            )
        # The ranks wait a moment for the copies before they agree: one round, not many.
        wait_s = min(_SYNC_WAIT_S, max(0.0, deadline - time.monotonic()))
        sync = CopySync(waits, wait_s)
        steps.run(lambda op=sync: steps.emit(op, OpResult()))
        steps.sync()
        steps.run(lambda: None)  # apply what was agreed (a ``CopiesDone``) and send it


__all__ = ["CopiesNotDone", "CopyCompletion", "unready", "wait_ready"]
