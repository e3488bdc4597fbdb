"""The model-runner interface: how an engine runs its model inside a tpcache rank.

tpcache owns the KV pool shard of each rank, the cache that hands out its slots and the
rank's process group; an engine owns the model. A runner joins them: it declares the KV
layout its model needs (``kv_layout``), tpcache sizes the pool from it (capacity agreed
by MIN over the ranks, as for any pool), the runner loads its shard of the weights
(``load``), and for each forward tpcache hands it ONE batch (``run``): per request the
new tokens, their positions, the slots to write their K and V at, and the slots of the
whole context to read (and the SWA slots with the hybrid cache), every slot id checked
against the rank's own cache first. What ``run`` returns (logits of the last positions,
or of every new position when asked, or sampled token ids) goes back to the caller.

Order of calls on one rank: the constructor (``Class(**args)``: cheap, loads nothing,
also run by the coordinator to learn the layout), ``kv_layout`` (pure), ``load`` (once),
then ``check_batch`` and ``run`` for every forward, in the coordinator's order. ``run``
is collective: it enters the same collectives in the same order on every rank (the
batch is the same on every rank); ``check_batch`` must not enter any collective, since
its verdict is agreed by MIN before ``run`` starts.

Two runners ship: ``tpcache.model.reference:ReferenceRunner`` (the built-in checking
model) and ``tpcache.model.llama:LlamaRunner`` (a standard decoder: RMSNorm, RoPE,
grouped-query attention, SwiGLU), which loads Hugging Face checkpoints of the Llama,
Mistral, Qwen2 and Qwen3 families (``model=DIR``) exactly or refuses them by name
(``RunnerConfigError`` kinds in ``errors``). The batch records, and the paged attention
both of them use, live in ``batch``; naming a runner (``"module:Class"`` and arguments)
in ``runner_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from tpcache.errors import TpcacheError
from tpcache.kv.pool import TORCH_DTYPES, KVPool, PoolSpec, check_positive_int
from tpcache.model.batch import RunnerBatch
from tpcache.model.errors import RunnerConfigError


@dataclass(frozen=True)
class LayerKV:
    """Which pool, and which layer of it, holds one model layer's K and V."""

    pool: str  # "full" or "swa"
    index: int
    window: int | None  # None: full attention


@dataclass(frozen=True)
class KVLayout:
    """The KV a model keeps per token: ``num_layers`` layers of ``kv_heads`` heads of
    ``head_dim`` (totals over the TP group) in ``dtype``. ``swa_layers``: the layers that
    attend over a sliding ``window`` (the tokens before the current one they see).
    ``replicate_kv``: with fewer KV heads than ranks (tp a multiple of ``kv_heads``), each
    rank keeps a copy of the one KV head its query heads use, as engines do."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    swa_layers: tuple[int, ...] = ()
    window: int | None = None
    replicate_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name), RunnerConfigError)
        if self.dtype not in TORCH_DTYPES:
            raise RunnerConfigError(f"dtype={self.dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        swa = self.swa_layers
        if list(swa) != sorted(set(swa)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers
            for i in swa
        ):
            raise RunnerConfigError(
                f"swa_layers={swa} must be distinct sorted layer indices in [0, {self.num_layers})"
            )
        if swa:
            check_positive_int("window", self.window, RunnerConfigError)
        elif self.window is not None:
            raise RunnerConfigError("a window without swa_layers means nothing; drop it")

    def placement(self, hybrid: bool) -> tuple[LayerKV, ...]:
        """Where each layer's KV lives: with an SWA pool (``hybrid``), sliding-window
        layers in it (in layer order) and full layers in the full pool; without, every
        layer in the full pool (a sliding layer then reads only its window from it)."""
        out: list[LayerKV] = []
        full = swa = 0
        for i in range(self.num_layers):
            window = self.window if i in self.swa_layers else None
            if hybrid and window is not None:
                out.append(LayerKV("swa", swa, window))
                swa += 1
            else:
                out.append(LayerKV("full", full, window))
                full += 1
        return tuple(out)

    def pool_layers(self, hybrid: bool) -> tuple[int, int]:
        """How many layers the full pool and the SWA pool must hold."""
        full = sum(p.pool == "full" for p in self.placement(hybrid))
        return full, self.num_layers - full

    def pool_spec(self, tp: int, window: int | None) -> PoolSpec:
        """The full pool of a TP group of ``tp`` ranks whose cache has the sliding
        ``window`` (None: no SWA pool). Raises RunnerConfigError unless ``kv_heads``
        divides by ``tp`` (or, with ``replicate_kv``, tp by ``kv_heads``: then one head a
        rank, ``tp`` in all), the cache's window is the model's, and the full pool keeps
        at least one layer."""
        check_positive_int("tp", tp, RunnerConfigError)
        heads = self.kv_heads
        if heads % tp and self.replicate_kv and tp % heads == 0:
            heads = tp  # each rank a copy of one KV head
        elif heads % tp:
            raise RunnerConfigError(
                f"kv_heads={self.kv_heads} does not divide by tp={tp}: each rank keeps whole heads"
                + (f" (or copies of one: tp a multiple of {heads})" if self.replicate_kv else "")
            )
        hybrid = window is not None
        if hybrid and self.swa_layers and window != self.window:
            raise RunnerConfigError(
                f"the model's window is {self.window}, the hybrid cache's {window}"
            )
        full, _swa = self.pool_layers(hybrid)
        if full == 0:
            raise RunnerConfigError("the hybrid cache needs a full-attention layer in the model")
        return PoolSpec(full, heads, self.head_dim, tp, self.dtype)


@dataclass(frozen=True)
class RankShard:
    """What a runner is loaded for: this rank of a TP group of ``tp``, on ``device``."""

    rank: int
    tp: int
    device: torch.device


@dataclass(frozen=True)
class KVShard:
    """This rank's pools as a runner sees them: ``placement[i]`` says where layer i's K
    and V are (``buffers(i)``: the live ``[slots, kv_heads // tp, head_dim]`` tensors).
    Writing through them is how a runner stores K and V; only at the batch's slots."""

    pool: KVPool
    swa_pool: KVPool | None
    placement: tuple[LayerKV, ...]

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = self.placement[layer]
        pool = self.swa_pool if where.pool == "swa" else self.pool
        assert pool is not None, "an SWA layer without an SWA pool"  # placement's invariant
        return pool.layer_buffers(where.index)


@dataclass(frozen=True)
class RunnerOutput:
    """What ``run`` returns; at least one of the two.

    ``logits``: float32 ``[rows, vocab]``, each request's rows in batch order: every new
    position's when its ``all_logits`` is set, else its last one's. ``token_ids``:
    int64 ``[requests]``, a token sampled at each request's last position.
    """

    logits: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


class Collectives(Protocol):
    """The rank's process group, as a runner uses it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a floating-point tensor over the ranks in place; returns it."""
        ...


@runtime_checkable
class ModelRunner(Protocol):
    """What an engine implements to run its model on a tpcache rank (module docstring)."""

    def kv_layout(self) -> KVLayout:
        """The KV the model keeps per token. Pure; callable before ``load``."""
        ...

    def load(self, shard: RankShard) -> None:
        """Load this rank's shard of the weights on ``shard.device``. Once, before any
        batch; not a collective."""
        ...

    def check_batch(self, batch: RunnerBatch) -> None:
        """Raise (ValueError) for a batch this runner cannot run, e.g. token ids outside
        its vocabulary. Changes nothing, enters no collective: every rank's verdict is
        agreed before ``run``, so a refusal stops every rank, none hangs."""
        ...

    def run(self, batch: RunnerBatch, kv: KVShard, group: Collectives) -> RunnerOutput:
        """Compute the batch: write each request's new K and V at its write slots, attend
        over its read slots, return the outputs. Collective. Changes the pools only at
        the batch's write slots."""
        ...


def torch_dtype(name: str, error: type[RunnerConfigError] = RunnerConfigError) -> torch.dtype:
    """The torch dtype a runner computes in, by its name; raises ``error`` for another."""
    if name not in TORCH_DTYPES:
        raise error(f"dtype={name!r} is not one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class RunnerInputError(TpcacheError, ValueError):
    """A batch the runner cannot take (a token id outside its vocabulary); the message
    says which."""


def check_vocab(tokens: torch.Tensor, vocab: int) -> None:
    """Raises ValueError unless every token id is in ``[0, vocab)``."""
    if tokens.numel() and not (int(tokens.min()) >= 0 and int(tokens.max()) < vocab):
        raise RunnerInputError(
            f"token ids span [{int(tokens.min())}, {int(tokens.max())}], "
            f"outside the vocab [0, {vocab})"
        )


class ShardRunner:
    """What the shipped runners share: the dtype they compute in, a spec with ``vocab``
    and ``layout(dtype)``, weights set once by ``load`` (owned here, never written after),
    and a batch check against the vocabulary. A bad ``dtype`` raises ``error``."""

    spec: Any

    def __init__(self, dtype: str, error: type[RunnerConfigError] = RunnerConfigError) -> None:
        self.dtype = torch_dtype(dtype, error)
        self.dtype_name = dtype
        self.w: dict[str, torch.Tensor] = {}

    def kv_layout(self) -> KVLayout:
        return self.spec.layout(self.dtype_name)

    def check_batch(self, batch: RunnerBatch) -> None:
        check_vocab(batch.tokens, self.spec.vocab)


__all__ = [
    "Collectives",
    "KVLayout",
    "KVShard",
    "LayerKV",
    "ModelRunner",
    "RankShard",
    "RunnerBatch",
    "RunnerConfigError",
    "RunnerOutput",
    "ShardRunner",
    "check_vocab",
    "torch_dtype",
]
