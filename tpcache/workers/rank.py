"""``RankWorker``: one TP rank. A plain class; the coordinator puts Ray on it at the edge.

It owns its head shard of the KV pool (on ``cuda:<local rank>`` or the CPU), its mirror
of the cache state machine, and its process group (set up by ``rank_setup.RankSetup``).
It applies steps in order through ``lockstep.apply_step``; nothing else changes its cache.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from tpcache.cache.protocol import Cache
from tpcache.group.spec import GroupError
from tpcache.kv.pool import KVPool
from tpcache.lockstep.errors import LockstepError
from tpcache.lockstep.ops import Step, StepResult, decode_step, encode
from tpcache.model.reference import ModelConfigError, ModelSpec, ReferenceRunner
from tpcache.model.runner import ModelRunner, RunnerConfigError
from tpcache.model.runner_spec import RunnerSpec, build_runner
from tpcache.transport.channel import Attach, RankLoop
from tpcache.transport.channel import serve as serve_channel
from tpcache.workers.protocol import apply_step, fail_step
from tpcache.workers.rank_setup import RankSetup
from tpcache.workers.spec import CacheSpec, WorkerSpec


class RankWorker(RankSetup):
    """One TP rank: KV-pool shard + cache mirror + process group, and the calls it serves.

    Call order: ``address`` (rank 0), ``join`` (all, concurrently), ``setup`` (all,
    concurrently: a collective; these three are ``RankSetup``'s), then ``apply`` for each
    step in step order.

    With ``spec.runner`` the constructor builds that model runner and loads its shard of
    the weights (raising RunnerConfigError unless ``spec.pool`` is the pool its layout
    asks for); ``load_model``/``load_runner`` install one later instead.
    """

    def __init__(self, rank: int, spec: WorkerSpec, local_rank: int = 0) -> None:
        super().__init__(rank, spec, local_rank)
        self._loop: RankLoop | None = None  # the step channel's loop, while it runs
        self._gc_frozen = False  # serve_steps froze the process's objects (gc.freeze)
        self.apply_cpu_s = 0.0  # process CPU seconds in ``apply``, since this rank started

    # ---- start-up again ------------------------------------------------------------------
    def rejoin(self, master_addr: str, master_port: int, store_path: str | None = None) -> int:
        """Leave the current (possibly broken) group, join a new one and start over with an
        empty cache and a fresh pool. Collective over the new group.

        Raises GroupError, leaving the old group alone and this process ``unfit``, if the
        old channel's loop is still in a step after ``timeout_s`` + 5 s: a group torn down
        or replaced under a collective in flight cannot be trusted."""
        wait_s = self.spec.timeout_s + 5.0
        if not self.stop_steps(wait_s):  # the old channel's loop goes first
            self.unfit = f"its step loop was still in a step {wait_s:g}s after it was asked to stop"
            raise GroupError(f"rank {self.rank} cannot rejoin: {self.unfit}")
        self._leave_group()  # not shutdown(): the new group's store may be in this dir
        self.pool = None
        self.cache = None
        return self.join_and_setup(master_addr, master_port, store_path)

    # ---- steps ------------------------------------------------------------------------
    def apply(self, data: bytes) -> bytes:
        """Apply one encoded step; returns the encoded ``StepResult``.

        Steps must come in order (Ray keeps one caller's order per actor). Raises
        ``RankFailure`` / ``DivergenceError`` on every rank together.
        """
        cpu = time.process_time()
        try:
            return self._apply(decode_step(data))
        finally:
            self.apply_cpu_s += time.process_time() - cpu

    def _apply(self, step: Step) -> bytes:
        if self.failed is None and step.step != self.last_step + 1:
            self.failed = f"expected step {self.last_step + 1}, got {step.step}"
        elif self.failed is None:
            try:
                result = self._apply_step(step)
            except LockstepError as exc:
                self.failed = f"step {step.step}: {exc.detail}"
                raise
            self.last_step = step.step
            return encode(result)
        raise fail_step(self._cache(), self._group(), self.rank, step, self.failed)

    def _apply_step(self, step: Step) -> StepResult:
        # A method of its own so that a test worker (tests/support/drill_worker.py) can plant a
        # fault in one step without a copy of ``apply``'s order check.
        return apply_step(self._cache(), self._group(), self.rank, step, copies=self.copies)

    # ---- the step channel (transport/channel.py) -----------------------------------------
    def serve_steps(self, attach: Attach) -> int:
        """Run this rank's side of the step channel until the hub says stop, its end is
        gone or ``stop_steps`` is called; returns the messages handled. A long call: under
        Ray the actor must run other calls (``health``, ``stop_steps``) on other threads.
        Raises ``ChannelConnectError`` (naming the endpoint and why) if the hub cannot be
        reached: under Ray, the coordinator reports that as why this rank's loop ended."""
        loop = RankLoop()
        self._loop = loop
        if not self._gc_frozen:
            # The process's objects so far (torch, Ray, the pool) live as long as it does:
            # out of the collector's scans, a full collection walks the cache's objects
            # alone instead of stopping every step behind it for a whole-heap walk.
            gc.freeze()
            self._gc_frozen = True
        return serve_channel(self, self.rank, attach, loop)

    def stop_steps(self, timeout: float = 60.0) -> bool:
        """Ask the channel loop to leave; waits up to ``timeout`` for it (a step in hand
        finishes first, its collectives bounded by ``timeout_s``). True if it left."""
        loop = self._loop
        if loop is None:
            return True
        loop.stop.set()
        return loop.done.wait(timeout)

    def health(self) -> tuple[int, float, str | None]:
        """(rank, seconds the channel loop has been busy with its message (0 when idle),
        why this rank cannot join a new group: a join in hand, or ``unfit``; None when it
        can). Answered on a thread of its own under Ray: a rank stuck in a step shows as
        busy; one still joining a failed recovery's group must be replaced (a join cannot
        be called off), and so must one whose join failed (see ``unfit``). Changes nothing."""
        busy = self._loop.busy_s() if self._loop is not None else 0.0
        since = self._joining_since
        if since is not None:
            return self.rank, busy, f"a join in hand for {time.monotonic() - since:.1f}s"
        return self.rank, busy, self.unfit

    def apply_steps(self, steps: list[bytes]) -> list[bytes]:
        """Apply encoded steps in order (one coalesced message); their results, in order.

        A step that fails raises as ``apply`` does, after the later ones have entered
        their collectives as failed steps (``fail_step``): a peer may go on with them.
        """
        out: list[bytes] = []
        first: LockstepError | None = None
        for data in steps:
            try:
                out.append(self.apply(data))
            except LockstepError as exc:
                first = first or exc
        if first is not None:
            raise first
        return out

    # ---- the model runner: ModelHost (workers/model_host.py) does the work -------------
    @property
    def runner(self) -> ModelRunner | None:
        return self.models.runner

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the runner since it was installed."""
        return self.models.tokens_computed

    def model_times(self) -> dict[str, float]:
        """This rank's forwards since its runner was installed: how many, the tokens they
        computed, the CPU and wall seconds inside the runner's ``run``, this process's
        CPU seconds so far and its torch threads (so a caller can tell the model's cost from the rest). Reads
        only."""
        m = self.models
        return {
            "forwards": m.forwards,
            "tokens": m.tokens_computed,
            "run_cpu_s": m.run_cpu_s,
            "run_wall_s": m.run_wall_s,
            "process_cpu_s": time.process_time(),
            # CPU outside the runner: applying steps (since this rank started), and a
            # forward's other phases (see ``ModelHost.phase_cpu_s``)
            "apply_cpu_s": self.apply_cpu_s,
            **{f"{k}_cpu_s": v for k, v in m.phase_cpu_s.items()},
            "torch_threads": torch.get_num_threads(),
        }

    def load_model(self, spec: ModelSpec) -> dict[str, Any]:
        """Install the built-in checking model ``spec`` in the pool's dtype (not a
        collective). Raises ``ModelConfigError``, the current runner kept, unless the pool
        holds its KV (heads, head_dim, a pool layer per full-attention layer, the window)."""
        runner = ReferenceRunner.of(spec, self.spec.pool.dtype)
        try:
            return self.models.install(runner, self.spec.pool, self.spec.cache.sliding_window)
        except RunnerConfigError as exc:
            raise ModelConfigError(str(exc)) from None

    def load_runner(self, target: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build the runner ``target`` (``"module:Class"``) with ``args`` and install it, as
        ``WorkerSpec.runner`` does. Not a collective. Raises RunnerSpecError or
        RunnerConfigError (the current runner kept) if it cannot be built or does not fit."""
        runner = build_runner(RunnerSpec.of(target, args))
        return self.models.install(runner, self.spec.pool, self.spec.cache.sliding_window)

    def forward(self, data: bytes) -> bytes:
        """An encoded ``Forward`` (one request) run as ``forward_batch`` runs a batch;
        returns an encoded ``ForwardResult``."""
        return encode(self.models.forward(self._group(), self._state, data, self.last_step))

    def forward_batch(self, data: bytes) -> bytes:
        """Run an encoded ``ForwardBatch``; an encoded ``ForwardBatchResult``. Collective:
        every item is checked against this rank's cache and by the runner, the verdict
        agreed by MIN (a bad command raises ``ForwardError`` on every rank before any
        compute); then the runner writes the new K and V. Changes the pools, not the cache."""
        return self.models.forward_batch(self._group(), self._state, data, self.last_step)

    def prepare_forward(self, data: bytes) -> str | None:
        """``forward_batch``'s first half, where the coordinator agrees the verdict itself
        (it sees every rank's answer): check an encoded ``ForwardBatch`` and keep it.
        Returns None, or why this rank refuses it. Not a collective; changes nothing."""
        return self.models.prepare_batch(self._state, data, self.last_step)

    def run_forward(self) -> bytes:
        """``forward_batch``'s second half, once every rank accepted the batch its last
        ``prepare_forward`` kept: run it (collective); an encoded ``ForwardBatchResult``.
        Raises ForwardError, computing nothing, if none is kept for this step."""
        return self.models.run_prepared(self._group(), self.last_step)

    def _state(self) -> tuple[Cache, KVPool]:
        return self._cache(), self._pool()

    # ---- inspection ---------------------------------------------------------------------
    def digest(self) -> int:
        return self._cache().digest()

    def check_integrity(self) -> None:
        self._cache().check_integrity()

    def info(self) -> dict[str, Any]:
        cache = self._cache()
        s = cache.sizes()
        return {
            "rank": self.rank,
            "device": str(self.device),
            "backend": self.group.backend if self.group else None,
            "last_step": self.last_step,
            "digest": cache.digest(),
            "free": s.free,
            "evictable": s.evictable,
            "protected": s.protected,
            "held": s.held,
            # Per pool (full, then SWA for a hybrid cache): capacity, free, evictable,
            # protected, held tokens.
            "pools": [
                [p.capacity, p.free, p.evictable, p.protected, p.held] for p in cache.pool_sizes()
            ],
            "pool_bytes": self._pool().nbytes,
            "tokens_computed": self.tokens_computed,
            "collectives": self.group.collectives if self.group else 0,
            # The host tier: copies started, agreed done, and done by this rank's engine.
            "copies": self.copies.state(cache) if self.copies is not None else None,
        }

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def collective_ping(self, payload: bytes = b"", collective: bool = True) -> int:
        """One bare all-reduce of one element (collective): with a round trip carrying
        ``payload`` (a step's bytes, unread), the floor of a step. ``collective`` False:
        the round trip alone (what a step that agrees nothing cannot avoid)."""
        del payload
        return self._group().agree_min([self.rank])[0] if collective else self.rank


__all__ = ["CacheSpec", "RankWorker", "WorkerSpec"]
