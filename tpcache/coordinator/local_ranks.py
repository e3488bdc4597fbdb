"""A TP group without Ray: the ranks as threads of this process, joined by a real gloo
group over an in-process store.

For tests, soaks and embedding where starting processes is not worth it: the same
``RankWorker``, the same lockstep protocol and the same gloo collectives as under Ray, in
one process (the collectives release the GIL, the cache work does not: this is a harness
for correctness, not for speed). Each rank has one thread that runs its jobs in order,
as a Ray actor does its calls. A hung rank's thread cannot be killed: recovery leaves it
behind (it exits once its call returns) and starts a new rank in a new thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tpcache.coordinator.build import Endpoints, GroupConfig, build_coordinator
from tpcache.coordinator.core import Coordinator
from tpcache.coordinator.errors import GroupConfigError
from tpcache.coordinator.step_types import RankCallError, first_cause
from tpcache.group.tp_group import TPGroup
from tpcache.logs import one_line
from tpcache.workers.rank import RankWorker
from tpcache.workers.spec import WorkerSpec

logger = logging.getLogger("tpcache.coordinator")


class _RankThread:
    """One rank's worker and the thread that runs its jobs in order."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.jobs: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self.thread = threading.Thread(
            target=self._loop, name=f"tpcache-rank-{worker.rank}", daemon=True
        )
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self.jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self.jobs.put(None)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
        self.worker.shutdown()
        self.worker.group = None  # the group goes with this thread, not at exit


class LocalRanks:
    """``RankTransport`` over ``tp`` rank threads in this process (see the module docstring).

    Owns the rank threads and the store their groups meet on; each (re)start of the group
    is a new generation with its own store prefix, so a left-behind rank never meets the
    new one.
    """

    def __init__(self, spec: WorkerSpec, worker_cls: type[RankWorker] = RankWorker) -> None:
        self.world_size = spec.pool.tp
        self.peer_check = True
        self.spec = spec
        self.worker_cls = worker_cls
        self._store = dist.HashStore()
        self._generation = 0
        self.replaced = 0  # rank threads started to replace hung or failed ones
        self.last_replaced: list[int] = []  # the ranks the last restart() replaced
        self.ranks = [_RankThread(worker_cls(r, spec)) for r in range(self.world_size)]
        self.capacity = self._form_group()
        logger.debug("%d ranks started as threads of this process", self.world_size)

    @property
    def workers(self) -> list[RankWorker]:
        return [r.worker for r in self.ranks]

    def _form_group(self) -> int:
        """Every rank sets up on a new gloo group (collective); returns the capacity."""
        self._generation += 1
        prefix = f"gen{self._generation}"
        n, timeout = self.world_size, timedelta(seconds=self.spec.timeout_s)

        def start(rank: int, worker: RankWorker) -> int:
            store = dist.PrefixStore(prefix, self._store)
            pg = dist.ProcessGroupGloo(store, rank, n, timeout)
            group = TPGroup.attach(pg, timeout_s=self.spec.timeout_s, where="in process")
            return worker.attach_and_setup(group)

        futs = [r.submit(lambda r=r: start(r.worker.rank, r.worker)) for r in self.ranks]
        caps = self._results(futs, self.spec.join_timeout_s + self.spec.timeout_s)
        return int(caps[0])

    # ---- RankTransport ------------------------------------------------------------------
    def send(self, steps: list[bytes]) -> list[Future]:
        return [r.submit(lambda w=r.worker: w.apply_steps(steps)) for r in self.ranks]

    def ready(self, ticket: list[Future]) -> bool:
        return all(f.done() for f in ticket)

    def collect(self, ticket: list[Future], timeout: float) -> list[list[bytes]]:
        per_rank = self._results(ticket, timeout)
        return [list(outs) for outs in zip(*per_rank, strict=True)]

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        futs = [r.submit(lambda w=r.worker: getattr(w, method)(*args)) for r in self.ranks]
        return self._results(futs, timeout)

    def paths(self) -> list[str]:
        return ["thread"] * self.world_size

    def call_on(self, rank: int, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """``RankWorker.<method>(*args)`` on ``rank`` alone, in order with the steps."""
        if not 0 <= rank < self.world_size:
            raise GroupConfigError(f"rank {rank} is outside [0, {self.world_size})")
        fut = self.ranks[rank].submit(lambda: getattr(self.ranks[rank].worker, method)(*args))
        return self._results([fut], timeout)[0]

    def restart(self, probe_s: float = 2.0) -> int:
        """Replace every rank that does not answer a ping within ``probe_s`` (hung, or
        its thread busy with a call that will not return), then start every rank over on
        a new group with an empty cache. Returns the agreed capacity."""
        pings = [r.submit(r.worker.ping) for r in self.ranks]
        self.last_replaced = []
        for i, fut in enumerate(pings):
            try:
                got = fut.result(timeout=probe_s)
                seen = None if got == i else f"it answered as rank {got}"
            except TimeoutError:
                seen = f"no answer to a ping within {probe_s:g} s"
            except Exception as exc:
                seen = f"its ping failed: {type(exc).__name__}: {one_line(exc, 200)}"
            if seen is not None:
                logger.warning("replacing rank %d (a thread of this process): %s", i, seen)
                self.ranks[i].stop()  # it exits once its current call returns
                self.ranks[i] = _RankThread(self.worker_cls(i, self.spec))
                self.replaced += 1
                self.last_replaced.append(i)
        return self._form_group()

    def close(self) -> None:
        """Stop the rank threads and drop their groups (waits briefly for each thread: a
        gloo group must not outlive the interpreter's shutdown). Idempotent."""
        for r in self.ranks:
            r.submit(r.worker.shutdown)
            r.stop()
        for r in self.ranks:
            r.thread.join(timeout=self.spec.timeout_s)
        self.ranks = []

    def _results(self, futs: list[Future], timeout: float) -> list[Any]:
        """Results in rank order; the first failure raises ``RankCallError`` naming the
        rank, a rank that does not answer within ``timeout`` a TimeoutError."""
        # Wait for all, but stop at the first failure: a failed rank is reported without
        # waiting out a hung peer (its peers raise together; a moment more lets the one
        # where it failed be named).
        done, _ = wait(futs, timeout=timeout, return_when=FIRST_EXCEPTION)
        failed = [f for f in futs if f in done and f.exception() is not None]
        if failed:
            done, _ = wait(futs, timeout=min(1.0, timeout))
            errors = [
                RankCallError(r, f.exception())  # type: ignore[arg-type]
                for r, f in enumerate(futs)
                if f in done and f.exception() is not None
            ]
            raise first_cause(errors)
        for rank, fut in enumerate(futs):
            if fut not in done:
                raise RankCallError(rank, TimeoutError(f"no reply within {timeout:g}s"))
        return [f.result() for f in futs]


def start_local_group(
    config: GroupConfig, worker_cls: type[RankWorker] = RankWorker
) -> Coordinator:
    """``service.start_group`` without Ray: ``config.tp`` rank threads in this process
    (gloo on the CPU; ``strategy``, ``use_gpus`` and ``backend`` do not apply)."""
    ends = Endpoints(config)
    try:
        ranks = LocalRanks(config.worker_spec(), worker_cls)
    except BaseException:
        ends.close()
        raise
    return build_coordinator(config, ranks, ranks.capacity, ends)


__all__ = ["LocalRanks", "start_local_group"]
