"""One process for N ranks: ``RankWorker``s joined by a thread group, driven by a coordinator.

The reference harness for the model tests: the same ``RankWorker``, lockstep protocol,
coordinator and engine as under Ray, with the ranks as threads of the test process and
the collectives done through a barrier (sums in rank order, so every rank gets the same
bits). Fast enough to run many seeds; Ray and torchrun tests then show the same holds
across processes.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.coordinator.step_types import RankCallError
from tpcache.engine.forward import ModelEngine
from tpcache.kv.pool import PoolSpec
from tpcache.model.reference import ModelSpec
from tpcache.workers.rank import CacheSpec, RankWorker, WorkerSpec


class ThreadGroup:
    """What N threads share to run collectives (one member per rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.values: list[Any] = [None] * world_size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.values[rank] = value
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()  # nobody writes the next round before everyone has read
        return out


class ThreadMember:
    """The ``TPGroup`` calls a rank uses, over a ``ThreadGroup``."""

    backend = "threads"

    def __init__(self, shared: ThreadGroup, rank: int) -> None:
        self.shared = shared
        self.rank = rank
        self.world_size = shared.world_size

    def all_min(self, values: list[int]) -> list[int]:
        rows = self.shared.exchange(self.rank, list(values))
        assert len({len(r) for r in rows}) == 1, f"ranks passed lists of lengths {rows}"
        return [min(col) for col in zip(*rows, strict=True)]

    def agree_min(self, values: list[int]) -> list[int]:
        return self.all_min(values)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(r) for r in self.shared.exchange(self.rank, list(values))]

    def digest_check(self, digest: int | None) -> tuple[int, int] | None:
        rows = self.shared.exchange(self.rank, digest)
        if any(d is None for d in rows):
            return None
        return min(rows), max(rows)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.shared.exchange(self.rank, t.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        t.copy_(total)
        return t

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return self.shared.exchange(self.rank, data)[src]

    def destroy(self) -> None:
        pass


class ThreadRanks:
    """``RankTransport`` over in-process ``RankWorker``s (a thread per rank per call)."""

    def __init__(self, spec: WorkerSpec, worker_cls: type[RankWorker] = RankWorker) -> None:
        tp = spec.pool.tp
        self.world_size = tp
        self.peer_check = True
        shared = ThreadGroup(tp)
        self.workers = [worker_cls(r, spec) for r in range(tp)]
        for r, w in enumerate(self.workers):
            w.group = ThreadMember(shared, r)  # type: ignore[assignment]
        self.pool = ThreadPoolExecutor(max_workers=tp)
        self.capacity = self._run("setup")[0]

    def _run(self, method: str, *args: Any) -> list[Any]:
        futs = [self.pool.submit(getattr(w, method), *args) for w in self.workers]
        out, first = [], None
        for rank, f in enumerate(futs):
            try:
                out.append(f.result(timeout=60))
            except Exception as exc:
                first = first or RankCallError(rank, exc)
        if first is not None:
            raise first
        return out

    def send(self, steps: list[bytes]) -> list[Any]:
        try:
            return ["ok", [self._run("apply", data) for data in steps]]
        except RankCallError as exc:
            return ["err", exc]

    def ready(self, ticket: list[Any]) -> bool:
        return True

    def collect(self, ticket: list[Any], timeout: float) -> list[list[bytes]]:
        if ticket[0] == "err":
            raise ticket[1]
        return ticket[1]

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        return self._run(method, *args)

    def restart(self, probe_s: float = 2.0) -> int:
        raise RuntimeError("thread ranks are not restarted")

    def paths(self) -> list[str]:
        return ["thread"] * self.world_size

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def local_engine(
    tp: int,
    model: ModelSpec,
    cache: CacheSpec,
    capacity: int,
    dtype: str = "float32",
    worker_cls: type[RankWorker] = RankWorker,
) -> ModelEngine:
    """An engine over ``tp`` thread ranks with ``model`` loaded; pool shaped for it."""
    hybrid = cache.sliding_window is not None
    layers = len(model.full_layers) if hybrid else model.num_layers
    spec = WorkerSpec(
        pool=PoolSpec(layers, model.heads, model.head_dim, tp, dtype),
        cache=cache,
        capacity_tokens=capacity,
        cpu_budget_bytes=1 << 26,
    )
    ranks = ThreadRanks(spec, worker_cls)
    fields = CoordinatorConfig.__dataclass_fields__
    config = CoordinatorConfig(**({"auto_recover": False} if "auto_recover" in fields else {}))
    coord = Coordinator(ranks, cache.build(ranks.capacity), config)
    ranks.call("load_model", model)
    return ModelEngine(coord)


def host_script(seed: int, vocab: int) -> list:
    """Three 32-token prefixes through a 96-token device pool: the first request's KV is
    written back to the host by the next two, then a continuation of it loads it back
    (and later waves hit the others' host and device copies)."""
    print(f"seed={seed}")
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    p = [draw(32) for _ in range(3)]
    return [[p[0] + draw(3)], [p[1] + draw(5)], [p[2] + draw(5)], [(0, draw(4))],
            [p[1] + draw(2), p[2][:20] + draw(3)]]  # fmt: skip
