"""``DrillWorker``: the rank worker with fault drills and a known KV pattern, for tests only (the product's
``RankWorker`` has none). Swapped in where a group is started (``start_group(...,
worker_cls=DrillWorker)``, ``start_local_group``, ``local_engine``) or by name
(``python -m tpcache.torchrun check --worker drill_worker:DrillWorker --drills``).

Ray actors of this class are pickled by value (below), so a Ray worker process need not
find this test directory on its path.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from tpcache.cache.protocol import Cache
from tpcache.kv.pool import KVPool, PoolSpec
from tpcache.lockstep.ops import Admit, Evict, Op, Step, StepResult, pack_tokens, unpack_tokens
from tpcache.model.batch import RunnerBatch
from tpcache.workers.protocol import apply_step
from tpcache.workers.rank import RankWorker
from tpcache.workers.rank_setup import RankNotReady

FAULTS = ("corrupt", "fail", "sleep", "crash")


class DrillWorker(RankWorker):
    """A ``RankWorker`` that can be told to fail at a given step or forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # step -> (kind, arg), the drills planted on this rank; cleared at every restart.
        self._faults: dict[int, tuple[str, float]] = {}
        # The next join's drill (see fail_next_join): (wait_s, tell), or None.
        self._join_drill: tuple[float, bool] | None = None

    def read_kv(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V of ``layer`` at ``slots`` of this rank's shard, as float32 arrays."""
        k, v = ready(self)[1].read(layer, slots)
        return k.float().cpu().numpy(), v.float().cpu().numpy()

    def request_slots(self, rid: int | str) -> list[int]:
        """The slot ids of running request ``rid`` on this rank (its whole row)."""
        cache = ready(self)[0]
        row = cache.request_row(rid)
        ps = cache.page_size
        return [int(p) * ps + o for p in row.pages for o in range(ps)][: row.num_tokens]

    def copy_drill(self, delay_s: float = 0.0, fail: list[int] | None = None) -> None:
        """This rank's later host copies take ``delay_s`` more each, and the ones with ids
        in ``fail`` fail. Raises RuntimeError without a host tier."""
        if self.copies is None:
            raise RuntimeError(f"rank {self.rank} has no host tier")
        self.copies.drill(delay_s, list(fail or []))

    def inject_fault(self, step: int, kind: str, arg: float = 0.0) -> None:
        """At ``step``: ``corrupt`` (apply a tampered op: the first Admit's first token
        +1, or an Evict of one more page), ``fail`` (the step's first op raises here: a
        local failure before the step's agreements), ``sleep`` (``arg`` seconds before
        applying), or ``crash`` (exit the process)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        self._faults[step] = (kind, arg)

    def plant_slot_error(self, shift: int = 1) -> None:
        """A wrong slot id on this rank: the next forward (after its check) reads position
        0 of its first request's context from slot ``slots[0] + shift``."""
        host = self.models
        assert host.runner is not None, "no runner loaded"
        host.runner = _ShiftOnce(host, host.runner, shift)  # type: ignore[assignment]

    def write_token_kv(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Write a known function of (token, layer, global head) at ``slots`` on every layer
        (``expected_token_kv``): a later prefix hit must read back exactly that."""
        pool = ready(self)[1]
        for layer in range(self.spec.pool.num_layers):
            k, v = expected_token_kv(self.spec.pool, self.rank, layer, tokens)
            pool.write(layer, slots, k.to(self.device), v.to(self.device))

    def fail_next_join(self, wait_s: float = 0.5, tell: bool = True) -> None:
        """This rank's next join fails for real: it waits ``wait_s`` alone at a rendezvous
        of its own that no peer comes to, then raises the product's GroupError, with
        torch's process-wide group state as any failed join leaves it. ``tell`` False:
        ``health`` does not report it (a rank whose word cannot be had), so only the
        coordinator's own reading of the failed call can find it."""
        self._join_drill = (wait_s, tell)

    def report_unfit(self, why: str) -> None:
        """From now on this rank says it cannot join a group again (``RankWorker.unfit``),
        as after a failed leave, though nothing here failed."""
        self.unfit = why

    def join(self, master_addr: str, master_port: int, store_path: str | None = None) -> str:
        drill, self._join_drill = self._join_drill, None
        if drill is None:
            return super().join(master_addr, master_port, store_path)
        wait_s, tell = drill
        alone = tempfile.mkdtemp(prefix="tpcache-drill-")
        spec = self.spec
        self.spec = dataclasses.replace(spec, join_timeout_s=wait_s)
        try:
            return super().join("127.0.0.1", 1, os.path.join(alone, "store"))
        finally:
            self.spec = spec
            shutil.rmtree(alone, ignore_errors=True)
            if not tell:
                self.unfit = None

    def attach_and_setup(self, group: Any) -> int:
        self._faults.clear()
        return super().attach_and_setup(group)

    def rejoin(self, master_addr: str, master_port: int, store_path: str | None = None) -> int:
        self._faults.clear()
        return super().rejoin(master_addr, master_port, store_path)

    def _apply_step(self, step: Step) -> StepResult:
        tamper = self._drill(step.step)
        cache, group = ready(self)[0], self.group
        if group is None:
            raise RankNotReady(f"rank {self.rank} has not joined its group")
        return apply_step(cache, group, self.rank, step, tamper, self.copies)

    def _drill(self, step: int) -> Callable[[Op], Op] | None:
        fault = self._faults.pop(step, None)
        if fault is None:
            return None
        kind, arg = fault
        if kind == "sleep":
            time.sleep(arg)
            return None
        if kind == "crash":
            os._exit(17)
        return _fail_first() if kind == "fail" else _corrupt_first


def ready(worker: RankWorker) -> tuple[Cache, KVPool]:
    """The worker's cache and pool shard; ``RankNotReady`` before its setup."""
    if worker.cache is None or worker.pool is None:
        raise RankNotReady(f"rank {worker.rank} is not set up")
    return worker.cache, worker.pool


class _ShiftOnce:
    """The host's runner for one forward, with the first context slot shifted; it puts
    the real runner back before running."""

    def __init__(self, host: Any, inner: Any, shift: int) -> None:
        self._host, self._inner, self._shift = host, inner, shift

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, batch: RunnerBatch, kv: Any, group: Any) -> Any:
        self._host.runner = self._inner
        first = batch.requests[0]
        slots = first.read_slots.clone()
        slots[0] = (slots[0] + self._shift) % kv.pool.num_slots
        first = dataclasses.replace(first, read_slots=slots)
        batch = dataclasses.replace(batch, requests=(first, *batch.requests[1:]))
        return self._inner.run(batch, kv, group)


def _fail_first() -> Callable[[Op], Op]:
    first = [True]

    def tamper(op: Op) -> Op:
        if first[0]:
            first[0] = False
            raise RuntimeError("planted failure (fault drill)")
        return op

    return tamper


def _corrupt_first(op: Op) -> Op:
    if isinstance(op, Admit):
        tokens = unpack_tokens(op.tokens).copy()
        tokens[0] += 1
        return msgspec.structs.replace(op, tokens=pack_tokens(tokens))
    if isinstance(op, Evict):
        return msgspec.structs.replace(op, num_tokens=op.num_tokens + 1)
    return op


def expected_token_kv(
    pool: PoolSpec, rank: int, layer: int, tokens: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``DrillWorker.write_token_kv`` stores for ``tokens`` on ``rank``'s heads."""
    h = pool.heads_per_rank
    heads = torch.arange(rank * h, (rank + 1) * h, dtype=torch.float64)
    dims = torch.arange(pool.head_dim, dtype=torch.float64)
    t = torch.as_tensor(np.asarray(tokens, dtype=np.float64))
    # Small exact values in every dtype: token mod 251, head, layer and dim mixed in.
    base = (t % 251)[:, None, None] + 256 * heads[None, :, None] + dims[None, None, :] / 64
    k = (base + 1024 * layer).to(pool.torch_dtype)
    v = (-base - 1024 * layer).to(pool.torch_dtype)
    return k, v


def _pickle_by_value() -> None:
    try:
        from ray import cloudpickle
    except ImportError:  # the in-process tests run without Ray
        return
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_pickle_by_value()
