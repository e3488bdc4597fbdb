"""The TP ranks as Ray actors: the one place ``RankWorker`` is wrapped by Ray.

One placement-group bundle per rank: one GPU each when the cluster has GPUs, a sliver of
CPU otherwise (CPU ranks mostly wait on collectives; a whole CPU each would not fit
four ranks on a two-core machine). Ranks may land on several nodes; the process group
meets at rank 0's node address.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpcache.coordinator.core import RankCallError
from tpcache.workers.rank import RankWorker, WorkerSpec

CPU_PER_RANK = 0.01
RankActor = ray.remote(RankWorker)


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


class RayRanks:
    """The ``RankTransport`` over Ray actors. Owns the actors and their placement group."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        use_gpus: bool | None = None,
        strategy: str = "PACK",
        worker_cls: type[RankWorker] = RankWorker,
        start_timeout_s: float = 120.0,
    ) -> None:
        tp = spec.pool.tp
        self.world_size = tp
        self.spec = spec
        gpus = cluster_gpus() >= tp if use_gpus is None else use_gpus
        self.use_gpus = gpus
        bundle = {"GPU": 1, "CPU": CPU_PER_RANK} if gpus else {"CPU": CPU_PER_RANK}
        self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=start_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"could not place {tp} ranks ({bundle} each) within {start_timeout_s:g}s; "
                f"cluster has {ray.cluster_resources()}"
            ) from None
        actor_cls = RankActor if worker_cls is RankWorker else ray.remote(worker_cls)
        self.actors = [
            actor_cls.options(
                num_cpus=CPU_PER_RANK,
                num_gpus=1 if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i
                ),
            ).remote(i, spec, 0)
            for i in range(tp)
        ]
        try:
            addr, port = ray.get(self.actors[0].address.remote(), timeout=start_timeout_s)
            self.backends = self._get(
                [a.join.remote(addr, port) for a in self.actors], start_timeout_s
            )
            caps = self._get([a.setup.remote() for a in self.actors], start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.capacity = caps[0]
        self.master = (addr, port)

    # ---- RankTransport ------------------------------------------------------------------
    def send(self, data: bytes) -> list[Any]:
        return [a.apply.remote(data) for a in self.actors]

    def ready(self, ticket: list[Any]) -> bool:
        done, _ = ray.wait(ticket, num_returns=len(ticket), timeout=0, fetch_local=True)
        return len(done) == len(ticket)

    def collect(self, ticket: list[Any], timeout: float) -> list[bytes]:
        return self._get(ticket, timeout)

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        return self._get([getattr(a, method).remote(*args) for a in self.actors], timeout)

    # ---- life ---------------------------------------------------------------------------
    def close(self) -> None:
        for a in getattr(self, "actors", []):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None

    def _get(self, refs: list[Any], timeout: float) -> list[Any]:
        """Results in rank order; the first failure (by rank) raises ``RankCallError``."""
        deadline = time.monotonic() + timeout
        out: list[Any] = []
        first: RankCallError | None = None
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except RayActorError as exc:
                first = first or RankCallError(rank, exc, dead=True)
            except RayTaskError as exc:
                first = first or RankCallError(rank, getattr(exc, "cause", exc) or exc)
            except GetTimeoutError as exc:
                first = first or RankCallError(
                    rank, TimeoutError(f"no reply in {timeout:g}s: {exc}")
                )
        if first is not None:
            raise first
        return out
