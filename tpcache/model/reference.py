"""A small tensor-parallel decoder that runs on the KV pool: the proof that cached KV is right.

Made for checking the cache, so it does what a real engine does with it: embeddings,
``num_layers`` blocks of multi-head attention with rotary positions and an MLP, a final
norm and an LM head. Weights come from a seed (no downloads) and are identical in every
process. Tensor parallelism is Megatron's: each rank holds ``heads // tp`` heads (its
columns of Wq, Wk, Wv; its rows of Wo) and ``ffn // tp`` MLP units (columns of the up
projection, rows of the down projection); the row-parallel products are summed over the
group by an all-reduce, so every rank ends each block with the same hidden state.

The cached path (``ReferenceRunner.run``, the reference ``ModelRunner``) computes only a
batch's new tokens: it writes their K and V into the pool at the slot ids of the cache's
rows and attends over K and V *read back from the pool* at the slots of each request's
whole context. ``reference_logits`` is the same model computed over the whole sequence at
once, with full weights and no pool.

Sliding-window layers (``swa_layers``) see only the last ``window`` tokens before each
query. With the hybrid cache, their K and V live in the SWA pool at the SWA slots the
cache maps, and only the window is read.

May import torch, numpy and ``tpcache.model``/``tpcache.cache``; nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tpcache.kv.pool import check_positive_int
from tpcache.model.attention import attend, rms_norm, rotary
from tpcache.model.batch import RunnerBatch, paged_attention
from tpcache.model.runner import (
    Collectives,
    KVLayout,
    KVShard,
    RankShard,
    RunnerConfigError,
    RunnerOutput,
    ShardRunner,
    check_vocab,
    torch_dtype,
)


class ModelConfigError(RunnerConfigError):
    """A model shape that cannot work, or one that does not fit the pool or the cache."""


@dataclass(frozen=True)
class ModelSpec:
    """The model every rank and the reference build. ``window``: tokens a sliding-window
    layer sees before the current one (required iff ``swa_layers`` is not empty)."""

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    head_dim: int = 8
    ffn: int = 64
    num_layers: int = 2
    swa_layers: tuple[int, ...] = ()
    window: int | None = None
    seed: int = 0
    rope_base: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "heads", "head_dim", "ffn", "num_layers"):
            check_positive_int(name, getattr(self, name), ModelConfigError)
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary positions")
        swa = self.swa_layers
        if list(swa) != sorted(set(swa)) or any(not 0 <= i < self.num_layers for i in swa):
            raise ModelConfigError(
                f"swa_layers={swa} must be distinct sorted layer indices in [0, {self.num_layers})"
            )
        if swa and (not isinstance(self.window, int) or self.window < 1):
            raise ModelConfigError(f"swa_layers need a window >= 1, got {self.window!r}")
        if not swa and self.window is not None:
            raise ModelConfigError("a window without swa_layers means nothing; drop it")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.swa_layers)

    def full_logits(self, tokens: list[int], dtype: str) -> np.ndarray:
        """``reference_logits`` as numpy: what ``modelcheck`` compares against."""
        return reference_logits(self, tokens, dtype).numpy()

    def layout(self, dtype: str) -> KVLayout:
        return KVLayout(
            self.num_layers, self.heads, self.head_dim, dtype, self.swa_layers, self.window
        )

    def check_tp(self, tp: int) -> None:
        """Raises ModelConfigError unless heads and ffn split evenly over ``tp`` ranks."""
        if self.heads % tp or self.ffn % tp:
            raise ModelConfigError(
                f"heads={self.heads} and ffn={self.ffn} must both divide by tp={tp}"
            )


@functools.lru_cache(maxsize=4)
def full_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The whole model's weights (float32, CPU), drawn from ``spec.seed`` in a fixed order.

    The same spec gives bit-identical weights in every process. Read-only by contract.
    """
    g = torch.Generator().manual_seed(spec.seed)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float()

    d, hd = spec.hidden, spec.heads * spec.head_dim
    w = {"embed": draw(spec.vocab, d, scale=1.0)}
    for i in range(spec.num_layers):
        w[f"{i}.norm1"] = 1.0 + draw(d, scale=0.1)
        w[f"{i}.wq"] = draw(d, hd, scale=d**-0.5)
        w[f"{i}.wk"] = draw(d, hd, scale=d**-0.5)
        w[f"{i}.wv"] = draw(d, hd, scale=d**-0.5)
        w[f"{i}.wo"] = draw(hd, d, scale=hd**-0.5)
        w[f"{i}.norm2"] = 1.0 + draw(d, scale=0.1)
        w[f"{i}.up"] = draw(d, spec.ffn, scale=d**-0.5)
        w[f"{i}.down"] = draw(spec.ffn, d, scale=spec.ffn**-0.5)
    w["norm"] = 1.0 + draw(d, scale=0.1)
    w["head"] = draw(d, spec.vocab, scale=d**-0.5)
    return w


def shard_weights(spec: ModelSpec, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s Megatron shard: columns of Wq/Wk/Wv and of up (its heads and MLP
    units), rows of Wo and of down; embeddings, norms and the head are replicated."""
    spec.check_tp(tp)
    full = full_weights(spec)
    cols = slice(
        rank * spec.heads // tp * spec.head_dim, (rank + 1) * spec.heads // tp * spec.head_dim
    )
    units = slice(rank * spec.ffn // tp, (rank + 1) * spec.ffn // tp)
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        part = name.rsplit(".", 1)[-1]
        if part in ("wq", "wk", "wv"):
            t = t[:, cols]
        elif part == "wo":
            t = t[cols, :]
        elif part == "up":
            t = t[:, units]
        elif part == "down":
            t = t[units, :]
        out[name] = t.contiguous()
    return out


class ReferenceRunner(ShardRunner):
    """The built-in checking model as a ``ModelRunner``: one rank's shard, on the rank's
    device, in the pool's dtype. Arguments: ``ModelSpec``'s fields and ``dtype``
    (``tpcache.model.reference:ReferenceRunner`` with ``--runner-arg heads=8`` ...).

    Mixed precision: weights, activations and KV in ``dtype``; the residual stream, the
    row-parallel products (Wo, down: their weights rounded to the dtype, then held in
    float32) and their all-reduce in float32. So TP changes only the order of a float32
    sum, and a bf16 run differs from its bf16 reference by little more than that: the
    cache, not the TP rounding, decides whether they agree.

    ``run`` computes the whole batch's new tokens at once (one matmul per weight, one
    pair of all-reduces per layer, ``2 * num_layers`` in layer order on every rank) and
    changes the pools only at the batch's write slots.
    """

    def __init__(self, dtype: str = "float32", **fields: Any) -> None:
        super().__init__(dtype, ModelConfigError)
        if isinstance(fields.get("swa_layers"), list | tuple):
            fields["swa_layers"] = tuple(fields["swa_layers"])
        self.spec = ModelSpec(**fields)
        self.heads = 0  # set by load()

    @classmethod
    def of(cls, spec: ModelSpec, dtype: str) -> ReferenceRunner:
        return cls(dtype, **dataclasses.asdict(spec))

    def load(self, shard: RankShard) -> None:
        self.spec.check_tp(shard.tp)
        self.heads = self.spec.heads // shard.tp
        self.w = _cast(shard_weights(self.spec, shard.rank, shard.tp), self.dtype, shard.device)

    def run(self, batch: RunnerBatch, kv: KVShard, group: Collectives) -> RunnerOutput:
        spec, w, dt = self.spec, self.w, self.dtype
        t, hd = batch.num_tokens, spec.head_dim
        pos = batch.positions
        x = w["embed"][batch.tokens].float()  # the residual stream stays float32
        for i, where in enumerate(kv.placement):
            h = rms_norm(x, w[f"{i}.norm1"], spec.eps).to(dt)
            q = rotary((h @ w[f"{i}.wq"]).view(t, self.heads, hd), pos, spec.rope_base)
            k = rotary((h @ w[f"{i}.wk"]).view(t, self.heads, hd), pos, spec.rope_base)
            v = (h @ w[f"{i}.wv"]).view(t, self.heads, hd)
            a = paged_attention(batch, q, k, v, where.pool, where.window, kv.buffers(i))
            x = x + group.all_reduce_sum(a.float() @ w[f"{i}.wo"])  # row-parallel: sum heads
            h = rms_norm(x, w[f"{i}.norm2"], spec.eps).to(dt)
            x = x + group.all_reduce_sum(F.gelu(h @ w[f"{i}.up"]).float() @ w[f"{i}.down"])
        out = batch.output_rows(x)
        return RunnerOutput(logits=(rms_norm(out, w["norm"], spec.eps).to(dt) @ w["head"]).float())


def _cast(weights: dict[str, torch.Tensor], dt: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Weights rounded to ``dt`` on ``device``; the row-parallel ones (Wo, down) then held
    in float32, as the float32 sums they feed are."""
    out = {}
    for name, t in weights.items():
        t = t.to(device=device, dtype=dt)
        out[name] = t.float() if name.endswith((".wo", ".down")) else t
    return out


def reference_logits(
    spec: ModelSpec,
    tokens: torch.Tensor | list[int],
    dtype: str = "float32",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Full recompute without any cache: logits ``[T, vocab]`` (float32) of every position
    of ``tokens``, from the whole weights (TP=1 math), K and V of the whole sequence
    computed at once, causal and (for SWA layers) windowed masks. Same precision recipe
    as ``ReferenceRunner`` (weights and activations in ``dtype``, residual in float32).
    Changes nothing."""
    dt = torch_dtype(dtype, ModelConfigError)
    w = _cast(full_weights(spec), dt, device)
    toks = torch.as_tensor(tokens, dtype=torch.int64, device=device)
    check_vocab(toks, spec.vocab)
    t = int(toks.numel())
    pos = torch.arange(t, device=device)
    x = w["embed"][toks].float()
    for i in range(spec.num_layers):
        window = spec.window if i in spec.swa_layers else None
        h = rms_norm(x, w[f"{i}.norm1"], spec.eps).to(dt)
        q = rotary((h @ w[f"{i}.wq"]).view(t, spec.heads, -1), pos, spec.rope_base)
        k = rotary((h @ w[f"{i}.wk"]).view(t, spec.heads, -1), pos, spec.rope_base)
        v = (h @ w[f"{i}.wv"]).view(t, spec.heads, -1)
        x = x + attend(q, k, v, pos, pos, window).float() @ w[f"{i}.wo"]
        h = rms_norm(x, w[f"{i}.norm2"], spec.eps).to(dt)
        x = x + F.gelu(h @ w[f"{i}.up"]).float() @ w[f"{i}.down"]
    return (rms_norm(x, w["norm"], spec.eps).to(dt) @ w["head"]).float()
