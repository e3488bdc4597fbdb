"""The model side of one rank: the runner it hosts, the SWA pool the runner needs with a
hybrid cache, and the forwards (``RankWorker.forward`` / ``forward_batch`` delegate here).

A forward is collective and must never leave a peer waiting: each rank decodes the
command, checks every item against its own cache and asks the runner to check the batch,
then the verdict is agreed by MIN (``agree_min``, -1 for a refusal) before the runner
enters any collective. So a bad command raises ``ForwardError`` on every rank together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tpcache.kv.pool import KVPool, PoolSpec
from tpcache.lockstep.ops import (
    ForwardBatch,
    ForwardBatchResult,
    ForwardResult,
    decode_forward,
    decode_forward_batch,
    encode,
)
from tpcache.model.batch import RunnerBatch
from tpcache.model.context import ForwardError, check_forward_batch, to_batch
from tpcache.model.runner import (
    KVLayout,
    KVShard,
    ModelRunner,
    RankShard,
    RunnerConfigError,
    RunnerOutput,
)

if TYPE_CHECKING:
    from tpcache.workers.copysync import RankCopies

# (cache, pool) of the rank now: read inside the checked part, so a rank that is not set
# up refuses through the agreement instead of leaving its peers in it.
State = Callable[[], tuple[Any, KVPool]]
_COPY_WAIT_S = 10.0  # most a forward waits for this rank's own host copies


def _describe(p: PoolSpec) -> str:
    return f"{p.num_layers} layers x {p.kv_heads} KV heads x {p.head_dim} ({p.dtype}, tp={p.tp})"


class ModelHost:
    """Owns one rank's runner, its SWA pool and the forward counters (see module doc)."""

    def __init__(self, rank: int, tp: int, device: torch.device) -> None:
        self.rank = rank
        self.tp = tp
        self.device = device
        # Owned here: set together by install(); the runner is the rank's only model.
        self.runner: ModelRunner | None = None
        self.layout: KVLayout | None = None
        self.tokens_computed = 0  # tokens run through the runner since install
        # The rank's host tier (set by the rank with its cache; None without one): a
        # forward first waits for the copies still reading pages it writes (copysync.py).
        self.copies: RankCopies | None = None
        self.forwards = 0  # runner calls since install
        # CPU and wall seconds inside the runner's run (process CPU: torch's own threads
        # count too), so what a step costs outside the model can be told apart.
        self.run_cpu_s = 0.0
        self.run_wall_s = 0.0
        # Process CPU seconds of a forward's other phases: decoding and checking the
        # command ("prepare"), the agreement on it ("agree"), the reply ("result").
        self.phase_cpu_s = dict.fromkeys(("prepare", "agree", "result"), 0.0)
        # What ``prepare_batch`` kept for ``run_prepared``: (the step it follows, the
        # command, its batch, its KV); None between the two calls' pairs.
        self._prepared: tuple[int, ForwardBatch, RunnerBatch, KVShard] | None = None
        # The SWA pool, built for one cache instance (a new cache after setup/rejoin gets
        # a new pool: its slots mean nothing to the new cache).
        self._swa_pool: KVPool | None = None
        self._swa_pool_cache: object | None = None

    def install(self, runner: ModelRunner, pool: PoolSpec, window: int | None) -> dict[str, Any]:
        """Check that ``runner``'s layout is what ``pool`` holds (the pool sized from this
        layout, with the cache's sliding ``window``), load its weights and make it this
        rank's runner. Not a collective. Raises RunnerConfigError with the old runner
        kept, if the layout does not fit."""
        layout = runner.kv_layout()
        want = layout.pool_spec(self.tp, window)
        if want != pool:
            raise RunnerConfigError(
                f"the runner's KV needs a pool of {_describe(want)}; "
                f"this rank's holds {_describe(pool)}"
            )
        runner.load(RankShard(self.rank, self.tp, self.device))
        self.runner, self.layout = runner, layout
        self.tokens_computed = self.forwards = 0
        self.run_cpu_s = self.run_wall_s = 0.0
        self.phase_cpu_s = dict.fromkeys(self.phase_cpu_s, 0.0)
        self._prepared = None
        self._swa_pool = self._swa_pool_cache = None
        full, swa = layout.pool_layers(window is not None)
        return {
            "rank": self.rank,
            "full_layers": full,
            "swa_layers": swa,
            "hybrid": window is not None,
        }

    # ---- forwards -------------------------------------------------------------------------
    def forward(self, group, state: State, data: bytes, after_step: int) -> ForwardResult:
        """One request's ``Forward`` (every new position's logits unless it says not)."""
        sent = []

        def decode() -> ForwardBatch:
            sent.append(decode_forward(data))
            return ForwardBatch(sent)

        res = self._forward(group, state, decode, after_step, every_rank=True)
        n, rows = res.computed[0], res.rows[0]
        end = sent[0].start + n
        return ForwardResult(self.rank, n, end, res.vocab, res.logits[: rows * res.vocab * 4])

    def forward_batch(self, group, state: State, data: bytes, after_step: int) -> bytes:
        """An encoded ``ForwardBatch``; returns the encoded ``ForwardBatchResult``."""
        return encode(self._forward(group, state, lambda: decode_forward_batch(data), after_step))

    # The same forward in two calls, where the coordinator sees every rank's answer (the
    # step channel) and so can agree the verdict itself: a collective costs a rank more
    # CPU than a message (about 0.3-0.5 ms against 0.05 ms at TP=2 on CPUs).
    def prepare_batch(self, state: State, data: bytes, after_step: int) -> str | None:
        """Decode and check an encoded ``ForwardBatch`` as ``forward_batch`` does, and keep
        it for ``run_prepared``; returns None, or why this rank refuses it (nothing
        kept). Not a collective; changes nothing else."""
        self._prepared = None
        t0 = time.process_time()
        try:
            cmd = decode_forward_batch(data)
            batch, kv = self._prepare(state, cmd, after_step)
        except Exception as exc:  # the coordinator tells every rank, none computes
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.phase_cpu_s["prepare"] += time.process_time() - t0
        self._prepared = (after_step, cmd, batch, kv)
        return None

    def run_prepared(self, group, after_step: int) -> bytes:
        """Run the batch the last ``prepare_batch`` kept (every rank accepted it); the
        encoded ``ForwardBatchResult``. Raises ForwardError, computing nothing, if none
        is kept or a step was applied since (its slots may have changed)."""
        kept, self._prepared = self._prepared, None
        if kept is None or kept[0] != after_step:
            raise ForwardError(
                f"rank {self.rank} holds no forward prepared after step {after_step}"
            )
        _, cmd, batch, kv = kept
        return encode(self._run(group, cmd, batch, kv, every_rank=False))

    def _forward(
        self,
        group,
        state: State,
        decode: Callable[[], ForwardBatch],
        after_step: int,
        every_rank: bool = False,
    ) -> ForwardBatchResult:
        """``every_rank``: this rank's logits go back whatever its rank (a single
        ``Forward``, whose callers compare them); else only rank 0's (see
        ``ForwardBatchResult``)."""
        problem = None
        t0 = time.process_time()
        try:
            cmd = decode()
            batch, kv = self._prepare(state, cmd, after_step)
        except Exception as exc:  # must reach the peers through the agreement, not hang them
            problem = f"{type(exc).__name__}: {exc}"
        t1 = time.process_time()
        verdict = group.agree_min([0 if problem is None else -1])[0]
        self.phase_cpu_s["prepare"] += t1 - t0
        self.phase_cpu_s["agree"] += time.process_time() - t1
        if verdict < 0:
            where = f"this rank ({self.rank}): {problem}" if problem else "another rank"
            raise ForwardError(f"forward refused on {where}")
        return self._run(group, cmd, batch, kv, every_rank)

    def _run(
        self, group, cmd: ForwardBatch, batch: RunnerBatch, kv: KVShard, every_rank: bool
    ) -> ForwardBatchResult:
        assert self.runner is not None
        cpu, wall = time.process_time(), time.perf_counter()
        out = self.runner.run(batch, kv, group)
        done = time.process_time()
        self.run_cpu_s += done - cpu
        self.run_wall_s += time.perf_counter() - wall
        wanted = [item.logits and (every_rank or self.rank == 0) for item in cmd.items]
        result = self._result(batch, out, wanted)
        self.phase_cpu_s["result"] += time.process_time() - done
        self.tokens_computed += batch.num_tokens
        self.forwards += 1
        return result

    def _prepare(
        self, state: State, cmd: ForwardBatch, after_step: int
    ) -> tuple[RunnerBatch, KVShard]:
        if self.runner is None or self.layout is None:
            raise ForwardError("no runner loaded (load_model, load_runner or WorkerSpec.runner)")
        cache, pool = state()
        check_forward_batch(cache, cmd)
        if self.copies is not None:  # bounded below the peers' collective timeout
            self.copies.before_forward(cache.host, [i.rid for i in cmd.items], _COPY_WAIT_S)
        batch = to_batch(cmd, self.device, after_step)
        self.runner.check_batch(batch)
        placement = self.layout.placement(cache.num_pools > 1)
        return batch, KVShard(pool, self._swa_pool_now(cache, pool), placement)

    def _result(
        self, batch: RunnerBatch, out: RunnerOutput, wanted: list[bool]
    ) -> ForwardBatchResult:
        """The wire record of ``out``, with the logit rows of the items ``wanted`` says;
        ForwardError if the runner broke its contract (the same on every rank for a
        deterministic runner, so nobody waits on a peer)."""
        reqs = batch.requests
        logits, ids = out.logits, out.token_ids
        if logits is None and ids is None:
            raise ForwardError("the runner returned neither logits nor token ids")
        rows = [0] * len(reqs)
        vocab, data, top, check = 0, b"", b"", b""
        if logits is not None:
            computed = [r.rows for r in reqs]
            if logits.dim() != 2 or logits.shape[0] != sum(computed):
                raise ForwardError(
                    f"the runner returned logits of shape {tuple(logits.shape)}, "
                    f"expected [{sum(computed)}, vocab]"
                )
            vocab = int(logits.shape[1])
            top, check, rows, data = _summaries(logits, computed, wanted)
        tokens = b""
        if ids is not None:
            if tuple(ids.shape) != (len(reqs),):
                raise ForwardError(
                    f"the runner returned {tuple(ids.shape)} token ids for {len(reqs)} requests"
                )
            tokens = ids.detach().cpu().numpy().astype("<i8").tobytes()
        n = [r.n for r in reqs]
        return ForwardBatchResult(self.rank, n, rows, vocab, data, tokens, top, check)

    # ---- the SWA pool --------------------------------------------------------
    def _swa_pool_now(self, cache, pool: KVPool) -> KVPool | None:
        """The SWA pool of the current cache (built on first use for each new cache)."""
        assert self.layout is not None
        layers = self.layout.pool_layers(True)[1]
        if cache.num_pools < 2 or layers == 0:
            return None
        if self._swa_pool is None or self._swa_pool_cache is not cache:
            self._swa_pool = None  # free the old one first
            spec = dataclasses.replace(pool.spec, num_layers=layers)
            slots = cache.pool_sizes()[1].capacity  # tokens, one slot each
            self._swa_pool = KVPool(spec, slots, self.device)
            self._swa_pool_cache = cache
        return self._swa_pool


def _summaries(
    logits: torch.Tensor, computed: list[int], wanted: list[bool]
) -> tuple[bytes, bytes, list[int], bytes]:
    """Per item (``computed[i]`` rows each): its last row's argmax and the logit there,
    and its rows where ``wanted``; as ``(top, top_logit, rows, logits)`` of
    ``ForwardBatchResult``. One pass over the last rows: fresh logits are out of the CPU's
    caches after the head's matmul, and each pass over a decode batch's (16 x 8k floats)
    costs about 0.1 ms here. Reduced where the logits are (a GPU's), so only what goes
    back crosses to the host; on a CPU numpy's argmax is several times torch's speed."""
    x = logits.detach().float()
    counts = np.asarray(computed, dtype=np.int64)
    ends = np.cumsum(counts)
    one_row_each = x.shape[0] == len(computed)  # decodes: no copy of the last rows
    if x.device.type == "cpu":
        last = x.numpy() if one_row_each else x.numpy()[ends - 1]
        top = last.argmax(axis=1)
        peak = last[np.arange(len(computed)), top]
    else:
        rows_of = x if one_row_each else x[torch.as_tensor(ends - 1, device=x.device)]
        best = rows_of.max(dim=1)
        top, peak = best.indices.cpu().numpy(), best.values.cpu().numpy()
    top_bytes = top.astype("<i8").tobytes()
    peak_bytes = peak.astype("<f8").tobytes()
    rows = [c if w else 0 for c, w in zip(computed, wanted, strict=True)]
    if not any(rows):
        return top_bytes, peak_bytes, rows, b""
    if not all(wanted):
        keep = np.repeat(np.asarray(wanted, dtype=bool), counts)
        x = x[torch.as_tensor(keep, device=x.device)]
    data = np.ascontiguousarray(x.cpu().numpy(), dtype="<f4").tobytes()
    return top_bytes, peak_bytes, rows, data
