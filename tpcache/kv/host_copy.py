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

The engine owns its thread; ``close()`` stops it at once: a rank closes its engine when
its cache is rebuilt, so the queued copies' results are no longer wanted. Jobs not started
are dropped; a copy in hand finishes first (a CPU copy cannot be interrupted, and on CUDA
its stream work is waited for, so no pool is freed or reused under it).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpcache.errors import TpcacheError
from tpcache.kv.pool import KVPool

TO_HOST, TO_DEVICE = "d2h", "h2d"
_MOST_TAKEN = 256  # jobs taken off the queue at once (bounds a group's size)
_JOIN_S = 30.0  # most close() waits for a copy in hand (a hung device, not a slow queue)


class CopyEngineClosed(TpcacheError, RuntimeError):
    """A job submitted to a closed engine (its pools belong to a cache that is gone)."""


class CopyJobError(TpcacheError, ValueError):
    """A copy job or pool the copy engine cannot take; the message says which."""


class CopyFailed(TpcacheError, RuntimeError):
    """A host copy failed (on CPU ranks only through a fault drill)."""


@dataclass(frozen=True)
class CopyJob:
    """Copy slots ``src`` of one pool to slots ``dst`` of the other, every layer."""

    id: int
    kind: str  # TO_HOST (device -> host) or TO_DEVICE (host -> device)
    src: np.ndarray  # int64 slot ids
    dst: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in (TO_HOST, TO_DEVICE):
            raise CopyJobError(f"copy kind must be {TO_HOST!r} or {TO_DEVICE!r}, got {self.kind!r}")
        if self.src.shape != self.dst.shape or self.src.ndim != 1:
            raise CopyJobError(
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
            raise CopyJobError("the host pool must have the device pool's spec")
        self.device, self.host = device, host
        self.delay_s = delay_s
        self.fail = set(fail)
        self._next = 0  # the id the next submitted job must have
        self._done = 0  # jobs finished (a prefix of the ids)
        self.failed: set[int] = set()
        self.copied_bytes = 0
        self._lock = threading.Lock()
        # Set by close(), read by the engine's thread before each group (and by its drill
        # delay): once set, no job starts. Under ``_lock`` too for the readers of counts.
        self._closed = threading.Event()
        # Each job with, on CUDA, an event of the submitter's stream: the copy stream
        # waits for it, so a copy never reads KV that a forward queued before it has not
        # written yet. None wakes the thread to see ``_closed``.
        self._jobs: queue.Queue[tuple[CopyJob, Any] | None] = queue.Queue()
        cuda = device.device.type == "cuda"
        self._stream = torch.cuda.Stream(device.device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="tpcache-copies", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        """Queue ``job``; its id must be the next one. Raises ValueError otherwise, and
        CopyEngineClosed after ``close``; nothing is queued then."""
        with self._lock:  # held to the put: a job queued behind close()'s drain is lost
            if self._closed.is_set():
                raise CopyEngineClosed(f"copy job {job.id} submitted to a closed engine")
            if job.id != self._next:
                raise CopyJobError(f"copy job {job.id} submitted, expected {self._next}")
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
        """``done()``, or -1 if any job has failed or the engine is closed: read under one
        lock, as the engine's thread sets them (a failure read apart from its count could
        be counted as done). A closed engine's dropped jobs never finish, so no count of
        it may be agreed: a step that still holds it fails instead."""
        with self._lock:
            return -1 if self.failed or self._closed.is_set() else self._done

    def wait(self, count: int, timeout: float) -> bool:
        """Until ``count`` jobs are done or ``timeout``; True if they are. False at once
        from a closed engine that has not done them (they never will be)."""
        deadline = time.monotonic() + timeout
        while self.done() < count:
            if self._closed.is_set() or time.monotonic() > deadline:
                return self.done() >= count
            time.sleep(0.0005)
        return True

    def close(self) -> bool:
        """Stop: later ``submit`` calls raise, queued jobs that have not started are
        dropped (never run, neither done nor failed), ``done_ok`` is -1 from now on.
        Waits for a copy in hand (up to 30 s for a hung device), then for the copy
        stream; True if the thread has ended. Idempotent; the pools stay referenced by
        the thread until it ends, so none is freed under a copy."""
        with self._lock:
            self._closed.set()
            while True:  # drop the queue now: its jobs' arrays and events go with it
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            self._jobs.put(None)
        self._thread.join(_JOIN_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for group, ready in self._groups(self._take()):
                    if self._closed.is_set():
                        break  # close() came: the rest of this take is dropped
                    self._run_group(group, ready)
        finally:
            if self._stream is not None:
                # Nothing queued on the stream may outlive the thread: the pools and the
                # pinned buffers it reads and writes are freed once the thread lets go.
                self._stream.synchronize()

    def _take(self) -> list[tuple[CopyJob, Any]]:
        """The jobs queued now, in order (waits for one, or for ``close``)."""
        items: list[tuple[CopyJob, Any]] = []
        item = self._jobs.get()
        while item is not None:
            items.append(item)
            if len(items) >= _MOST_TAKEN:
                break
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
        return items

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
            # The drill's delay stands for a slow copy that has not begun: close() ends it,
            # and the group is dropped as if still queued.
            if self.delay_s and self._closed.wait(self.delay_s):
                return
            if jobs[0].id in self.fail:
                raise CopyFailed(f"copy {jobs[0].id} failed (fault drill)")
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


__all__ = ["TO_DEVICE", "TO_HOST", "CopyEngine", "CopyEngineClosed", "CopyJob", "host_pool"]
