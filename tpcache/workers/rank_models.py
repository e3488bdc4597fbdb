"""The model runner's calls of a rank (``RankWorker`` mixes this in): reading KV,
installing a runner, and the forwards. Not part of the cache state machine: a forward
changes the pools, never the cache, and is checked against the cache first
(``workers/model_host.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.radix import RadixCache
from tpcache.workers.group import TPGroup
from tpcache.workers.kvpool import KVPool
from tpcache.workers.model import ModelConfigError, ModelSpec, ReferenceRunner
from tpcache.workers.model_host import ModelHost
from tpcache.workers.ops import encode
from tpcache.workers.runner import ModelRunner, RunnerConfigError
from tpcache.workers.runner_spec import RunnerSpec, build_runner
from tpcache.workers.spec import WorkerSpec


class RankModels:
    """The runner half of ``RankWorker``: what it reads of the rank is declared here, and
    ``RankWorker`` provides it (its spec, its ``ModelHost``, its last applied step, and
    its group, cache and pool, each raising RuntimeError before set-up)."""

    spec: WorkerSpec
    models: ModelHost  # owned by the rank
    last_step: int

    def _group(self) -> TPGroup:
        raise NotImplementedError

    def _cache(self) -> RadixCache:
        raise NotImplementedError

    def _pool(self) -> KVPool:
        raise NotImplementedError

    # ---- KV data (the model's side; not part of the cache state) ------------------------
    def read_kv(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k, v = self._pool().read(layer, slots)
        return k.float().cpu().numpy(), v.float().cpu().numpy()

    # ---- the model runner (workers/runner.py, workers/model_host.py) ----------------------
    @property
    def runner(self) -> ModelRunner | None:
        return self.models.runner

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the runner since it was installed."""
        return self.models.tokens_computed

    def load_model(self, spec: ModelSpec) -> dict[str, Any]:
        """Install the built-in checking model ``spec`` (``ReferenceRunner``) on this
        rank's device, in the pool's dtype. Not a collective. Raises ``ModelConfigError``
        (the current runner kept) unless the pool holds the model's KV (heads, head_dim,
        one pool layer per full-attention layer, the hybrid cache's window)."""
        runner = ReferenceRunner.of(spec, self.spec.pool.dtype)
        try:
            return self.models.install(runner, self.spec.pool, self.spec.cache.sliding_window)
        except RunnerConfigError as exc:
            raise ModelConfigError(str(exc)) from None

    def load_runner(self, target: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build the runner ``target`` (``"module:Class"``) with ``args`` here and install
        it, as ``WorkerSpec.runner`` does at construction. Not a collective. Raises
        RunnerSpecError / RunnerConfigError (the current runner kept) if it cannot be
        built or its layout does not fit this rank's pool."""
        runner = build_runner(RunnerSpec.of(target, args))
        return self.models.install(runner, self.spec.pool, self.spec.cache.sliding_window)

    def forward(self, data: bytes) -> bytes:
        """Run the runner on an encoded ``Forward`` (one request); returns an encoded
        ``ForwardResult``. As ``forward_batch`` for a batch of one."""
        return encode(self.models.forward(self._group(), self._state, data, self.last_step))

    def forward_batch(self, data: bytes) -> bytes:
        """Run the runner on an encoded ``ForwardBatch``; returns an encoded
        ``ForwardBatchResult``.

        Collective (every rank, same order, same command). Every item is first checked
        against this rank's own cache (``check_forward_batch``) and by the runner
        (``check_batch``), and the verdict agreed by MIN, so a bad command raises
        ``ForwardError`` on every rank before any compute. Then the runner writes the new
        tokens' K and V and enters its collectives. Changes the pools, not the cache.
        """
        return self.models.forward_batch(self._group(), self._state, data, self.last_step)

    def _state(self) -> tuple[RadixCache, KVPool]:
        return self._cache(), self._pool()
