"""The group's figures, as ``Coordinator.stats()`` reports them: the step pipeline's
counters, the mirror's pool, the ranks' health and recovery, the event endpoints'.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from tpcache.cache.tallies import host_figures
from tpcache.coordinator.call_lock import CallLock
from tpcache.coordinator.steps import StepPipeline


def group_figures(
    steps: StepPipeline,
    event_stats: Callable[[], tuple[int, int]] | None,
    metrics_port: int | None,
) -> dict[str, Any]:
    """The figures of the group ``steps`` drives (a new dict; reads the mirror, so the
    caller holds ``steps.lock``). ``event_stats``: the KV events published and dropped."""
    c = steps.counters
    mirror = steps.mirror
    ranks = steps.ranks
    health = steps.recovery
    r = health.state
    s = mirror.sizes()
    lat = list(c.latencies_s)
    published, dropped = event_stats() if event_stats else (0, 0)
    return {
        "tp": ranks.world_size,
        "steps_sent": steps.steps_sent,
        "steps_done": c.steps_done,
        "messages_sent": c.messages,
        "inflight": steps.steps_inflight,
        "waiting": steps.steps_waiting,
        "ops": c.ops,
        "queries": c.queries,
        "query_tokens": c.query_tokens,
        "hit_tokens": c.hit_tokens,
        "hit_rate": c.hit_tokens / c.query_tokens if c.query_tokens else 0.0,
        "capacity": s.capacity,
        "free": s.free,
        "evictable": s.evictable,
        "protected": s.protected,
        "held": s.held,
        "running": len(mirror.running_ids()),
        "evicted_tokens": mirror.stats().evicted_pages[0] * mirror.page_size,
        "divergences": c.divergences,
        "rank_failures": c.rank_failures,
        "recoveries": c.recoveries,
        "last_recovery_s": c.last_recovery_s,
        "replaced_ranks": getattr(ranks, "replaced", 0),
        "rank_paths": ranks.paths(),
        "step_latency_ms_median": statistics.median(lat) * 1e3 if lat else 0.0,
        "digest": mirror.digest(),
        "broken": str(health.broken) if health.broken else None,
        # Retried recovery: failed attempts since start, whether attempts go on, the
        # last failure, and seconds to the next attempt (0 when healthy).
        "recovery_failures": r.failures,
        "recovering": health.attempts_go_on,
        "last_recovery_error": r.last_error,
        "next_recovery_in_s": max(0.0, r.next_at - time.monotonic())
        if health.broken is not None
        else 0.0,
        "events_published": published,
        "events_dropped": dropped,
        "metrics_port": metrics_port,
        # A host tier's pool and moves, from the mirror (as evicted_tokens is).
        **host_figures(mirror),
        "stats_age_s": 0.0,
    }


class LastFigures:
    """Figures taken under a lock that a slow step may hold: the latest reading, kept
    (owned here) to answer with when the lock does not come in time."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None  # under the lock: the latest reading
        self._last_at = 0.0

    def take(self, lock: CallLock, wait_s: float, read: Callable[[], dict[str, Any]]) -> dict:
        """``read()`` under ``lock`` (a new dict); if another caller holds it longer than
        ``wait_s``, the last reading, ``stats_age_s`` saying how old (with none yet, it
        waits for the lock)."""
        if not lock.acquire(timeout=wait_s):
            if self._last is not None:
                return {**self._last, "stats_age_s": time.monotonic() - self._last_at}
            lock.acquire()
        try:
            self._last = read()
            self._last_at = time.monotonic()
            return dict(self._last)
        finally:
            lock.release()
