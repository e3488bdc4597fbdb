"""A rank's host (CPU) tier: its shard of the host KV pool, and the copies between it and
the device pool, run off the step path.

The host pool has the device pool's layout (per layer K and V, ``[slots, heads, dim]``)
with slot ids of its own; with CUDA its memory is pinned, so device-to-host and back can
run on a stream of their own while the rank goes on with steps. Copies are jobs with
consecutive ids (the op log numbers them identically on every rank); one worker thread
(and, on CUDA, one stream) runs them in id order, so what is done is always a prefix:
``done()`` is that prefix's length. A job that fails is counted done too and listed in
``failed``: the lockstep decides what a failure means (every rank must see it, so it
travels through the same agreement as the count).

The engine owns its thread; ``close()`` stops it (a job in hand finishes first).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpcache.workers.kvpool import KVPool

TO_HOST, TO_DEVICE = "d2h", "h2d"
_MOST_TAKEN = 256  # jobs taken off the queue at once (bounds a group's size)


@dataclass(frozen=True)
class CopyJob:
    """Copy slots ``src`` of one pool to slots ``dst`` of the other, every layer."""

    id: int
    kind: str  # TO_HOST (device -> host) or TO_DEVICE (host -> device)
    src: np.ndarray  # int64 slot ids
    dst: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in (TO_HOST, TO_DEVICE):
            raise ValueError(f"copy kind must be {TO_HOST!r} or {TO_DEVICE!r}, got {self.kind!r}")
        if self.src.shape != self.dst.shape or self.src.ndim != 1:
            raise ValueError(
                f"copy {self.id}: {self.src.size} source slots, {self.dst.size} targets"
            )


class CopyEngine:
    """Runs copy jobs between ``device`` and ``host`` (two pools of one spec) in id order.

    ``delay_s`` makes every job that much slower, and ``fail`` lists job ids that fail:
    fault drills for tests (a slow rank must hold back the group's completion, never its
    correctness; a failure must fail everywhere). Thread-safe: ``submit`` and ``done``
    from the rank's thread, the copies on the engine's own.
    """

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        *,
        delay_s: float = 0.0,
        fail: frozenset[int] = frozenset(),
    ) -> None:
        if device.spec != host.spec:
            raise ValueError("the host pool must have the device pool's spec")
        self.device, self.host = device, host
        self.delay_s = delay_s
        self.fail = set(fail)
        self._next = 0  # the id the next submitted job must have
        self._done = 0  # jobs finished (a prefix of the ids)
        self.failed: set[int] = set()
        self.copied_bytes = 0
        self._lock = threading.Lock()
        # Each job with, on CUDA, an event of the submitter's stream: the copy stream
        # waits for it, so a copy never reads KV that a forward queued before it has not
        # written yet.
        self._jobs: queue.Queue[tuple[CopyJob, Any] | None] = queue.Queue()
        cuda = device.device.type == "cuda"
        self._stream = torch.cuda.Stream(device.device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="tpcache-copies", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        """Queue ``job``; its id must be the next one. Raises ValueError otherwise."""
        with self._lock:
            if job.id != self._next:
                raise ValueError(f"copy job {job.id} submitted, expected {self._next}")
            self._next += 1
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device.device))
        self._jobs.put((job, ready))

    def done(self) -> int:
        """How many jobs have finished (ids ``0 .. done() - 1``), failed ones included."""
        with self._lock:
            return self._done

    def done_ok(self) -> int:
        """``done()``, or -1 if any job has failed: both read under one lock, as the
        engine's thread sets them (a failure read apart from its count could be
        counted as done)."""
        with self._lock:
            return -1 if self.failed else self._done

    def wait(self, count: int, timeout: float) -> bool:
        """Until ``count`` jobs are done or ``timeout``; True if they are."""
        deadline = time.monotonic() + timeout
        while self.done() < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(30.0)

    def _run(self) -> None:
        while True:
            items, stop = self._take()
            for group, ready in self._groups(items):
                self._run_group(group, ready)
            if stop:
                return

    def _take(self) -> tuple[list[tuple[CopyJob, Any]], bool]:
        """The jobs queued now, in order (waits for one); and whether ``close`` came."""
        items = []
        item = self._jobs.get()
        while item is not None:
            items.append(item)
            if len(items) >= _MOST_TAKEN:
                return items, False
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return items, False
        return items, True

    def _groups(self, items: list[tuple[CopyJob, Any]]) -> list[tuple[list[CopyJob], Any]]:
        """Consecutive jobs of one kind run as one copy (a job's fixed cost, ~0.1 ms on CPU,
        is most of a small page's copy). Safe in id order: a group reads one pool and
        writes the other, so it reads nothing it writes; a job whose targets overlap the
        group's starts a new group (the later write must win). Drilled jobs (a delay, or a
        planted failure) run alone, as the drills describe them."""
        groups: list[tuple[list[CopyJob], Any]] = []
        targets: set[int] = set()
        for job, ready in items:
            alone = self.delay_s > 0 or job.id in self.fail
            if groups and not alone:
                last, _ = groups[-1]
                dst = job.dst.tolist()
                fits = last[0].kind == job.kind and last[0].id not in self.fail
                if fits and targets.isdisjoint(dst):
                    last.append(job)
                    targets.update(dst)
                    groups[-1] = (last, ready)  # the latest job's event covers the earlier
                    continue
            groups.append(([job], ready))
            targets = set(job.dst.tolist())
        return groups

    def _run_group(self, jobs: list[CopyJob], ready: Any) -> None:
        ok = False
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if jobs[0].id in self.fail:
                raise RuntimeError(f"copy {jobs[0].id} failed (fault drill)")
            if ready is not None:
                self._stream.wait_event(ready)  # type: ignore[union-attr]
            if len(jobs) == 1:
                self._copy(jobs[0])
            else:
                src = np.concatenate([j.src for j in jobs])
                self._copy(
                    CopyJob(jobs[0].id, jobs[0].kind, src, np.concatenate([j.dst for j in jobs]))
                )
            ok = True
        except Exception:
            pass  # counted below: every rank learns of it through the agreement
        with self._lock:
            if not ok:
                self.failed.update(j.id for j in jobs)
            self._done += len(jobs)

    def _copy(self, job: CopyJob) -> None:
        src_pool, dst_pool = (
            (self.device, self.host) if job.kind == TO_HOST else (self.host, self.device)
        )
        src = torch.as_tensor(job.src, dtype=torch.int64)
        dst = torch.as_tensor(job.dst, dtype=torch.int64)
        spec = self.device.spec
        for layer in range(spec.num_layers):
            for s_buf, d_buf in zip(
                src_pool.layer_buffers(layer), dst_pool.layer_buffers(layer), strict=True
            ):
                self._move(s_buf, src, d_buf, dst)
        self.copied_bytes += int(job.src.size) * spec.bytes_per_slot

    def _move(
        self, s_buf: torch.Tensor, src: torch.Tensor, d_buf: torch.Tensor, dst: torch.Tensor
    ) -> None:
        if self._stream is None:
            d_buf.index_copy_(0, dst, s_buf.index_select(0, src))
            return
        with torch.cuda.stream(self._stream):
            rows = s_buf.index_select(0, src.to(s_buf.device, non_blocking=True))
            rows = rows.to(d_buf.device, non_blocking=True)
            if d_buf.device.type == "cpu":
                # Device to host: ``rows`` is a pinned buffer the stream fills later, and
                # the CPU's index_copy_ runs at once (no stream orders it): wait first.
                self._stream.synchronize()
                d_buf.index_copy_(0, dst, rows)
                return
            d_buf.index_copy_(0, dst.to(d_buf.device, non_blocking=True), rows)
        self._stream.synchronize()


def host_pool(device: KVPool, num_slots: int) -> KVPool:
    """A host pool with ``device``'s spec and ``num_slots`` slots of its own, on the CPU
    (pinned memory when CUDA is there, so copies can overlap the rank's work)."""
    return KVPool(device.spec, num_slots, torch.device("cpu"), pin=torch.cuda.is_available())


__all__ = ["TO_DEVICE", "TO_HOST", "CopyEngine", "CopyJob", "host_pool"]
