"""Prometheus metrics of one coordinator, and the KV-event publishing hook.

Counters and gauges are read from ``Coordinator.stats()`` at scrape time (a custom
collector), so a scrape and ``stats()`` always agree. Latency histograms are observed
as steps complete. A registry of its own per coordinator: two coordinators in one
process (tests) never share series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tpcache.cache.protocol import Cache
from tpcache.closing import Closing
from tpcache.errors import TpcacheError

if TYPE_CHECKING:
    from tpcache.events.publisher import EventPublisher


class Observed(Protocol):
    """What the metrics read of a coordinator (a ``Coordinator``): its ``stats()`` and
    the mirror's eviction counters. A protocol, so ``events`` never imports the driver
    that builds it."""

    @property
    def mirror(self) -> Cache: ...

    def stats(self) -> dict[str, Any]: ...


_COUNTERS = {
    "queries": ("tpcache_prefix_queries", "Admitted requests whose prompt was matched"),
    "query_tokens": ("tpcache_prefix_query_tokens", "Prompt tokens looked up"),
    "hit_tokens": ("tpcache_prefix_hit_tokens", "Prompt tokens found cached"),
    "evicted_tokens": ("tpcache_evicted_tokens", "Tokens evicted from the cache"),
    "steps_done": ("tpcache_steps", "Steps applied and verified on every rank"),
    "messages_sent": (
        "tpcache_rank_messages",
        "Messages sent to every rank (fewer than steps when steps were coalesced)",
    ),
    "ops": ("tpcache_ops", "Cache operations logged"),
    "divergences": ("tpcache_divergences", "Steps after which ranks disagreed"),
    "rank_failures": ("tpcache_rank_failures", "Steps that failed on a rank"),
    "recoveries": ("tpcache_recoveries", "Times the TP group was rebuilt"),
    "recovery_failures": (
        "tpcache_recovery_failures",
        "Recovery attempts that failed (a rank died or hung while the group was rebuilt)",
    ),
    "events_published": ("tpcache_kv_events_published", "KV events accepted by the publisher"),
    "events_dropped": ("tpcache_kv_events_dropped", "KV events dropped from the live stream"),
}
_GAUGES = {
    "capacity": ("tpcache_pool_capacity_tokens", "KV slots in the device pool"),
    "free": ("tpcache_pool_free_tokens", "Free KV slots"),
    "evictable": ("tpcache_cache_evictable_tokens", "Cached tokens no request holds"),
    "protected": ("tpcache_cache_protected_tokens", "Cached tokens locked by running requests"),
    "held": ("tpcache_pool_held_tokens", "KV slots held by running requests, not cached"),
    "used": ("tpcache_pool_used_tokens", "KV slots in use (capacity - free)"),
    "running": ("tpcache_running_requests", "Requests admitted and not finished"),
    "inflight": ("tpcache_steps_inflight", "Steps sent and not yet verified"),
    "waiting": ("tpcache_steps_waiting", "Steps closed and not yet sent (coalescing)"),
    "hit_rate": ("tpcache_prefix_hit_rate", "hit_tokens / query_tokens since start"),
    "broken": ("tpcache_group_broken", "1 while the TP group is down (recovering or stopped)"),
    "recovering": ("tpcache_group_recovering", "1 while recovery attempts go on"),
}

# A host tier's series, only where the cache has one (``Coordinator.stats``' host keys).
_HOST_COUNTERS = {
    "host_hit_tokens": ("tpcache_host_hit_tokens", "Prompt tokens loaded back from the host tier"),
    "written_back_tokens": ("tpcache_host_written_tokens", "Tokens copied to the host tier"),
    "host_evicted_tokens": (
        "tpcache_host_evicted_tokens",
        "Tokens dropped from the host tier by its eviction",
    ),
}
_HOST_GAUGES = {
    "host_capacity": ("tpcache_host_capacity_tokens", "KV slots in the host pool"),
    "host_free": ("tpcache_host_free_tokens", "Free slots in the host pool"),
    "host_evictable": ("tpcache_host_evictable_tokens", "Host-only cached tokens"),
    "host_protected": (
        "tpcache_host_copy_tokens",
        "Host copies of tokens also cached on the device",
    ),
    "copies_pending": ("tpcache_host_copies_pending", "Host copies started, not yet agreed done"),
}


class _StatsCollector:
    def __init__(self, coord: Observed) -> None:
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        stats = self.coord.stats()
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0) or 0)
        for key, (name, doc) in _GAUGES.items():
            if key == "used":
                value = stats["capacity"] - stats["free"]
            else:
                value = float(bool(stats[key])) if key == "broken" else float(stats[key])
            yield GaugeMetricFamily(name, doc, value=value, labels=None)
        if "host_capacity" in stats:
            for key, (name, doc) in _HOST_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=stats[key])
            for key, (name, doc) in _HOST_GAUGES.items():
                yield GaugeMetricFamily(name, doc, value=float(stats[key]), labels=None)


class MetricsError(TpcacheError, RuntimeError):
    """The metrics endpoint could not be served (the message names the address)."""


class CoordinatorMetrics(Closing):
    """A coordinator's metrics: ``serve(port, host)`` exposes them over HTTP (bound
    before the ranks start, so a taken port fails fast), ``attach(coord)`` feeds them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.step_latency = Histogram(
            "tpcache_step_latency_seconds",
            "From closing a step to every rank's verified result",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry,
        )
        self.evict_time = Histogram(
            "tpcache_evict_seconds",
            "Time of one eviction call in the coordinator's mirror",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.1),
            registry=self.registry,
        )
        self._coord: Observed | None = None
        self._evictions_seen = 0
        self.server: WSGIServer | None = None  # set by serve, cleared by close

    def attach(self, coord: Observed) -> None:
        """Read ``coord``'s stats at every scrape, and observe its steps."""
        self._coord = coord
        self.registry.register(_StatsCollector(coord))  # type: ignore[arg-type]

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint on ``host`` (loopback unless the operator names another
        address; the metrics carry no token ids) and ``port`` (0 picks one); returns the
        port. Raises ``MetricsError`` if it cannot bind."""
        try:
            self.server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        del thread
        return int(self.server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # ---- StepObserver ---------------------------------------------------------------------
    def step_sent(self, step: int, events: list) -> None:
        if self._coord is None:
            return
        mirror = self._coord.mirror
        calls = mirror.stats().evict_calls
        # A recovery may replace the mirror with a fresh cache, whose count starts at 0.
        new = calls - self._evictions_seen if calls >= self._evictions_seen else calls
        if new:
            # The cache keeps the seconds of its last calls only: some may be gone.
            for s in mirror.evict_seconds(new):
                self.evict_time.observe(s)
        self._evictions_seen = calls

    def step_done(self, step: int, latency_s: float) -> None:
        self.step_latency.observe(latency_s)


class EventsHook:
    """Publishes each step's KV events (the mirror's, identical to every rank's)."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher

    def step_sent(self, step: int, events: list) -> None:
        if events:
            self.publisher.publish(events)

    def step_done(self, step: int, latency_s: float) -> None:
        pass
