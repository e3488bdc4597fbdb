"""What a TP group is configured with (``GroupConfig``), and assembling its coordinator
over ranks that have started (``build_coordinator``): mirror, KV events, metrics.

No Ray here: ``service.start_group`` starts Ray ranks, ``local_ranks.start_local_group``
thread ranks, and both finish through ``build_coordinator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.coordinator.errors import GroupConfigError
from tpcache.coordinator.step_types import RankTransport, StepObserver
from tpcache.events.event_config import EventConfig
from tpcache.events.metrics import CoordinatorMetrics, EventsHook
from tpcache.events.publisher import EventPublisher
from tpcache.group.spec import check_seconds
from tpcache.kv.pool import PoolSpec
from tpcache.model.runner_spec import RunnerSpec, RunnerSpecError, runner_pool
from tpcache.workers.spec import CacheSpec, WorkerSpec

# The Ray placement strategies and step paths a group may ask for (ranks.py checks them
# too; they are here so a config is checked without Ray).
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRANSPORTS = ("channel", "ray")


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
    gpus_per_rank: float = 1.0  # with GPUs: each rank's bundle
    strategy: str = "PACK"  # Ray placement of the ranks: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    # Custom Ray resources each rank's bundle asks for (e.g. {"node_a": 1} to pin ranks to
    # nodes that have it): one dict for every rank, or a list of one dict per rank.
    rank_resources: dict[str, float] | list[dict[str, float]] | None = None
    transport: str = "channel"  # the per-step path: "channel" (ZMQ) or "ray" (actor calls)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    events: EventConfig | None = None  # None: no KV events published
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0 picks a port
    metrics_host: str = "127.0.0.1"  # loopback unless the operator names an address
    # The model runner every rank builds ("package.module:Class") with these keyword
    # arguments (plain data); its KV layout then shapes the pool, and num_layers,
    # kv_heads, head_dim and dtype above are not used. ``runner_spec.runner_options``
    # makes both from ``--runner``/``--runner-arg``.
    runner: str | None = None
    runner_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Before start_group binds an events endpoint or starts a rank.
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("join_timeout_s", self.join_timeout_s)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise GroupConfigError(f"tp must be an int >= 1, got {self.tp!r}")
        if self.use_gpus is not None and not isinstance(self.use_gpus, bool):
            raise GroupConfigError(f"use_gpus must be True, False or None, got {self.use_gpus!r}")
        if self.strategy not in STRATEGIES:
            raise GroupConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.transport not in TRANSPORTS:
            raise GroupConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        g = self.gpus_per_rank
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 < g <= 64:
            raise GroupConfigError(f"gpus_per_rank must be a number in (0, 64], got {g!r}")
        self.resources_of(0)  # checks rank_resources
        self.runner_spec()  # checks the runner's name and arguments (imports nothing)

    def resources_of(self, rank: int) -> dict[str, float]:
        """The custom resources of ``rank``'s bundle. Raises ValueError for a malformed
        ``rank_resources`` (names must be non-empty strings, amounts numbers > 0)."""
        res = self.rank_resources
        if res is None:
            return {}
        if isinstance(res, list):
            if len(res) != self.tp:
                raise GroupConfigError(f"rank_resources lists {len(res)} dicts for {self.tp} ranks")
            per = res
        else:
            per = [res] * self.tp
        for d in per:
            if not isinstance(d, dict) or not all(
                isinstance(k, str)
                and k
                and k not in ("CPU", "GPU", "memory")
                and not isinstance(v, bool)
                and isinstance(v, int | float)
                and 0 < v < math.inf  # (a NaN fails both)
                for k, v in d.items()
            ):
                raise GroupConfigError(
                    "rank_resources must map custom resource names to finite amounts > 0,"
                    f" got {d!r}"
                )
        return dict(per[rank])

    def runner_spec(self) -> RunnerSpec | None:
        """The runner, or None. Raises RunnerSpecError for a malformed name or arguments
        (or arguments without a runner)."""
        if self.runner is None:
            if self.runner_args:
                raise RunnerSpecError("runner_args need a runner")
            return None
        return RunnerSpec.of(self.runner, self.runner_args)

    def pool_spec(self) -> PoolSpec:
        """The pool of each rank: the runner's layout (its module imported and the runner
        constructed here, no weights loaded), else the fields above. Raises
        RunnerConfigError if the runner cannot be built or does not fit tp or the cache."""
        runner = self.runner_spec()
        if runner is not None:
            return runner_pool(runner, self.tp, self.cache.sliding_window)
        return PoolSpec(self.num_layers, self.kv_heads, self.head_dim, self.tp, self.dtype)

    def worker_spec(self) -> WorkerSpec:
        return WorkerSpec(
            pool=self.pool_spec(),
            cache=self.cache,
            capacity_tokens=self.capacity_tokens,
            cpu_budget_bytes=self.cpu_budget_bytes,
            gpu_fraction=self.gpu_fraction,
            backend=self.backend,
            timeout_s=self.timeout_s,
            join_timeout_s=self.join_timeout_s,
            runner=self.runner_spec(),
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
    observers: list[StepObserver] = []
    event_stats = None
    if publisher is not None:
        observers.append(EventsHook(publisher))

        def event_stats() -> tuple[int, int]:
            st = publisher.stats()
            return st.published_events, st.dropped_events

    if ends.metrics is not None:
        observers.append(ends.metrics)
    coord = Coordinator(
        ranks,
        mirror,
        config.coordinator,
        observers,
        publisher=publisher,
        event_stats=event_stats,
        metrics_port=ends.metrics_port,
    )
    if ends.metrics is not None:
        ends.metrics.attach(coord)  # its collector reads the coordinator's stats()
    return coord
