"""Starting a TP group, serving it as a named Ray actor, and connecting frontends to it.

``start_group`` builds ranks + mirror + coordinator in the calling process.
``CoordinatorService`` is the same behind a named (optionally detached) Ray actor, so a
frontend on any node of the cluster reaches it with ``connect(name, namespace)``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from tpcache.cache.keys import TokenLike
from tpcache.coordinator import api
from tpcache.coordinator.core import Admission, Coordinator, CoordinatorConfig
from tpcache.coordinator.event_config import EventConfig
from tpcache.coordinator.frontend import handle, handle_many
from tpcache.coordinator.metrics import CoordinatorMetrics, EventsHook
from tpcache.coordinator.publisher import EventPublisher
from tpcache.coordinator.ranks import RayRanks
from tpcache.workers.group import check_seconds
from tpcache.workers.kvpool import PoolSpec
from tpcache.workers.rank import RankWorker
from tpcache.workers.spec import CacheSpec, WorkerSpec

DEFAULT_NAMESPACE = "tpcache"


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


def start_group(config: GroupConfig, worker_cls: type[RankWorker] = RankWorker) -> Coordinator:
    """Start ``config.tp`` rank actors, agree the capacity, and return their coordinator,
    publishing KV events and serving metrics if configured.

    Needs ``ray.init`` first. ``coordinator.close()`` stops the ranks and the endpoints.
    Raises ``EventConfigError``/``EventPublisherError`` for a bad events endpoint before
    any rank starts.
    """
    publisher = EventPublisher(config.events) if config.events is not None else None
    try:
        ranks = RayRanks(
            config.worker_spec(),
            use_gpus=config.use_gpus,
            strategy=config.strategy,
            worker_cls=worker_cls,
        )
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    mirror = config.cache.build(ranks.capacity, record_events=publisher is not None)
    coord = Coordinator(ranks, mirror, config.coordinator)
    if publisher is not None:
        coord.observers.append(EventsHook(publisher))
        coord.publisher = publisher

        def event_stats() -> tuple[int, int]:
            st = publisher.stats()
            return st.published_events, st.dropped_events

        coord.event_stats = event_stats
    if config.metrics_port is not None:
        metrics = CoordinatorMetrics(coord)
        coord.metrics_port = metrics.serve(config.metrics_port)
        coord.observers.append(metrics)
    return coord


class CoordinatorService:
    """The coordinator behind a Ray actor (plain class; ``ray.remote`` is applied in
    ``serve``). Frontends call ``call``/``calls`` with encoded ``api`` messages.

    A background thread checks the ranks' health every ``health_interval_s`` so a rank
    that dies while the group is idle is noticed (and replaced) within a few seconds.
    Every entry point holds one lock: the coordinator itself is single-threaded.
    """

    def __init__(self, config: GroupConfig, health_interval_s: float = 2.0) -> None:
        self.config = config
        self.coord = start_group(config)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        with contextlib.suppress(Exception):  # not inside an actor: no restart to detect
            if ray.get_runtime_context().was_current_actor_reconstructed:
                self.coord.restart_note = (
                    f"the coordinator restarted at {time.strftime('%Y-%m-%d %H:%M:%S')}"
                )
        if health_interval_s > 0:
            threading.Thread(
                target=self._watch, args=(health_interval_s,), name="tpcache-health", daemon=True
            ).start()

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock, contextlib.suppress(Exception):  # errors reach frontends
                self.coord.check_health()

    def call(self, data: bytes) -> bytes:
        with self._lock:
            return handle(self.coord, data)

    def calls(self, items: list[bytes]) -> list[bytes]:
        with self._lock:
            return handle_many(self.coord, items)

    def sync(self) -> None:
        with self._lock:
            self.coord.sync()

    def rank_digests(self) -> list[int]:
        with self._lock:
            self.coord.sync()
            return list(self.coord.ranks.call("digest"))

    def rank_pids(self) -> list[int]:
        with self._lock:
            return list(self.coord.ranks.call("pid"))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.coord.stats()

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            self.coord.close()


def serve(
    config: GroupConfig,
    name: str = "tpcache",
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = False,
) -> Any:
    """Start the coordinator as a named actor in ``namespace``; returns its handle."""
    # Restarted by Ray if its process dies; it then starts a fresh group (empty cache).
    opts: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "num_cpus": 0,
        "max_restarts": -1,
        "max_concurrency": 4,  # frontends' calls serialise on the service's lock
    }
    if detached:
        opts["lifetime"] = "detached"
    actor = ray.remote(CoordinatorService).options(**opts).remote(config)
    ray.get(actor.stats.remote())  # wait until the group is up (raises if it failed)
    return actor


class Client:
    """A frontend's handle on a served coordinator: the same calls as ``Coordinator``,
    over encoded messages; errors come back as the same typed exceptions."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _call(self, call: api.Call) -> api.Reply:
        reply = api.decode_reply(ray.get(self.actor.call.remote(api.encode(call))))
        if isinstance(reply, api.ErrorReply):
            api.raise_reply_error(reply)
        return reply

    def admit(
        self, request_id: Any, tokens: TokenLike, priority: int = 0, reserve: int = 0
    ) -> Admission:
        r = self._call(api.AdmitCall(request_id, _ints(tokens), priority, reserve))
        assert isinstance(r, api.AdmitReply)
        slots = np.asarray(r.slots, dtype=np.int64)
        return Admission(r.prefix_len, slots, slots.size, 1)

    def extend(self, request_id: Any, n: int) -> np.ndarray:
        r = self._call(api.ExtendCall(request_id, n))
        assert isinstance(r, api.SlotsReply)
        return np.asarray(r.slots, dtype=np.int64)

    def cache_unfinished(self, request_id: Any, tokens: TokenLike) -> int:
        r = self._call(api.CacheUnfinishedCall(request_id, _ints(tokens)))
        assert isinstance(r, api.CachedReply)
        return r.cached_tokens

    def finish(self, request_id: Any, output_tokens: TokenLike = ()) -> int:
        r = self._call(api.FinishCall(request_id, _ints(output_tokens)))
        assert isinstance(r, api.CachedReply)
        return r.cached_tokens

    def abort(self, request_id: Any) -> None:
        self._call(api.AbortCall(request_id))

    def stats(self) -> dict[str, Any]:
        r = self._call(api.StatsCall())
        assert isinstance(r, api.StatsReply)
        return dict(r.stats)

    def sync(self) -> None:
        ray.get(self.actor.sync.remote())


def _ints(tokens: TokenLike) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    return np.asarray(tokens).tolist()


def connect(name: str = "tpcache", namespace: str = DEFAULT_NAMESPACE) -> Client:
    """A client for the coordinator served as ``name`` in ``namespace`` (any node)."""
    return Client(ray.get_actor(name, namespace=namespace))
