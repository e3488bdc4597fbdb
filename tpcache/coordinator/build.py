"""What a TP group is configured with (``GroupConfig``), and assembling its coordinator
over ranks that have started (``build_coordinator``): mirror, KV events, metrics.

No Ray here: ``service.start_group`` starts Ray ranks, ``local_ranks.start_local_group``
thread ranks, and both finish through ``build_coordinator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.coordinator.event_config import EventConfig
from tpcache.coordinator.metrics import CoordinatorMetrics, EventsHook
from tpcache.coordinator.publisher import EventPublisher
from tpcache.coordinator.step_types import RankTransport
from tpcache.workers.group import check_seconds
from tpcache.workers.kvpool import PoolSpec
from tpcache.workers.spec import CacheSpec, WorkerSpec


@dataclass(frozen=True)
class GroupConfig:
    """Everything needed to start one TP group. ``capacity_tokens`` None: fit the budget.

    ``timeout_s`` bounds each collective, so a hung rank is found that fast;
    ``join_timeout_s`` bounds how long ranks wait for each other to join the group, at
    start-up and when recovery replaces a rank (a new process must start first).
    """

    tp: int = 2
    capacity_tokens: int | None = 1 << 20
    cache: CacheSpec = field(default_factory=CacheSpec)
    num_layers: int = 2
    kv_heads: int = 4
    head_dim: int = 8
    dtype: str = "float16"
    cpu_budget_bytes: int = 1 << 30
    gpu_fraction: float = 0.8
    backend: str = "auto"
    timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    use_gpus: bool | None = None
    strategy: str = "PACK"
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    events: EventConfig | None = None  # None: no KV events published
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0 picks a port
    metrics_host: str = "127.0.0.1"  # loopback unless the operator names an address

    def __post_init__(self) -> None:
        # Before start_group binds an events endpoint or starts a rank.
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("join_timeout_s", self.join_timeout_s)

    def worker_spec(self) -> WorkerSpec:
        return WorkerSpec(
            pool=PoolSpec(self.num_layers, self.kv_heads, self.head_dim, self.tp, self.dtype),
            cache=self.cache,
            capacity_tokens=self.capacity_tokens,
            cpu_budget_bytes=self.cpu_budget_bytes,
            gpu_fraction=self.gpu_fraction,
            backend=self.backend,
            timeout_s=self.timeout_s,
            join_timeout_s=self.join_timeout_s,
        )


class Endpoints:
    """The KV-event publisher and the metrics endpoint ``config`` asks for, bound before
    any rank starts (a bad or taken address fails fast); ``close`` if the ranks fail."""

    def __init__(self, config: GroupConfig) -> None:
        self.publisher = EventPublisher(config.events) if config.events is not None else None
        self.metrics: CoordinatorMetrics | None = None
        self.metrics_port: int | None = None
        if config.metrics_port is not None:
            try:
                self.metrics = CoordinatorMetrics()
                self.metrics_port = self.metrics.serve(config.metrics_port, config.metrics_host)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.metrics is not None:
            self.metrics.close()


def build_coordinator(
    config: GroupConfig, ranks: RankTransport, capacity: int, ends: Endpoints
) -> Coordinator:
    """The coordinator of started ``ranks`` (agreed ``capacity``), fed to the endpoints
    ``ends`` opened for it. ``coordinator.close()`` stops them all."""
    publisher = ends.publisher
    mirror = config.cache.build(capacity, record_events=publisher is not None)
    coord = Coordinator(ranks, mirror, config.coordinator)
    if publisher is not None:
        coord.observers.append(EventsHook(publisher))
        coord.publisher = publisher

        def event_stats() -> tuple[int, int]:
            st = publisher.stats()
            return st.published_events, st.dropped_events

        coord.event_stats = event_stats
    if ends.metrics is not None:
        ends.metrics.attach(coord)
        coord.metrics_port = ends.metrics_port
        coord.observers.append(ends.metrics)
    return coord
