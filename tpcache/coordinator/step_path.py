"""The per-step path of Ray ranks: the step channel (``transport/channel.py``) instead of a
Ray actor call per rank per message.

Ray still starts each rank's channel loop (one long actor call, ``serve_steps``, whose
result is also how a rank's death is seen at once), and carries the calls that must not
queue behind steps (``ping``, ``health``, ``pid``). Everything that touches a rank's cache
or pool goes through the channel, in order with the steps.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import ray
from ray.exceptions import RayTaskError

from tpcache.coordinator.step_types import RankCallError, first_cause
from tpcache.transport.channel import CALL, STEPS, ChannelError, RankErrors, StepHub

# Calls answered by the actor itself (Ray), not queued behind steps in the channel.
RAY_CALLS = frozenset(("ping", "health", "pid", "address", "local_store", "stop_steps"))


class ChannelPath:
    """The step channel to ``actors`` (rank order), the ranks in ``remote`` over CURVE TCP
    at ``host``, the others over IPC. Owns the hub and the loops' Ray references."""

    def __init__(
        self, actors: list[Any], remote: set[int], host: str, timeout: float, lag_s: float
    ) -> None:
        self.hub = StepHub(len(actors), remote, host)
        # A rank this much behind its peers in answering a step is hung (``Step.peer_check``
        # is off on this path: no collective of the step's own times such a rank out).
        self.lag_s = lag_s
        self._last_check = 0.0
        try:
            self.loops = [a.serve_steps.remote(self.hub.attach[r]) for r, a in enumerate(actors)]
            self.hub.wait_connected(timeout, self.dead)
        except ChannelError as exc:
            self.close()
            raise RankCallError(exc.rank, exc, dead=exc.dead) from None
        except BaseException:
            self.close()
            raise

    def dead(self) -> int | None:
        """A rank whose loop has ended (its process died, or the loop left), if any.
        Asks Ray at most every 200 ms: a local rank that dies closes its socket, which
        the hub sees at once; asking costs the coordinator about 0.1 ms of CPU. Raises ``ChannelError`` for a loop that ended with
        an error of its own (e.g. ``ChannelConnectError``: it never reached the hub):
        that, not a death, is the reason to report."""
        now = time.monotonic()
        if now - self._last_check < 0.2:
            return None
        self._last_check = now
        done, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        if not done:
            return None
        rank = self.loops.index(done[0])
        try:
            ray.get(done[0], timeout=0)
        except RayTaskError as exc:  # the loop raised; its actor lives
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, ChannelError):
                raise cause from None
            raise ChannelError(
                rank, f"its step loop failed: {type(cause).__name__}: {cause}"
            ) from None
        except Exception:  # the actor died (RayActorError): the hub says so
            pass
        return rank

    def send(self, steps: list[bytes], timeout: float) -> int:
        try:
            return self.hub.send(STEPS, steps, timeout)
        except ChannelError as exc:
            raise RankCallError(exc.rank, exc, dead=exc.dead) from None

    def ready(self, ticket: int) -> bool:
        return self.hub.ready(ticket)

    def collect(self, ticket: int, timeout: float) -> list[list[bytes]]:
        """Per step of the message, every rank's encoded result."""
        per_rank = self._collect(ticket, timeout, self.lag_s)
        return [list(outs) for outs in zip(*per_rank, strict=True)]

    def call(self, method: str, args: tuple, timeout: float, only: int | None = None) -> list[Any]:
        """``method(*args)`` on every rank (or on rank ``only``; the others give None)."""
        try:
            ticket = self.hub.send(CALL, [pickle.dumps((method, args, only))], timeout)
        except ChannelError as exc:
            raise RankCallError(exc.rank, exc, dead=exc.dead) from None
        return [pickle.loads(frames[0]) for frames in self._collect(ticket, timeout)]

    def _collect(
        self, ticket: int, timeout: float, lag_s: float | None = None
    ) -> list[list[bytes]]:
        try:
            return self.hub.collect(ticket, timeout, self.dead, lag_s)
        except RankErrors as exc:
            raise first_cause([RankCallError(r, e) for r, e in exc.errors]) from None
        except ChannelError as exc:
            raise RankCallError(exc.rank, exc, dead=exc.dead) from None

    def close(self) -> None:
        """Ask the loops to leave and close the hub (the loops also leave by themselves
        when their actor is told ``stop_steps``, or dies)."""
        self.hub.stop_ranks()
        self.hub.close()


__all__ = ["RAY_CALLS", "ChannelPath"]
