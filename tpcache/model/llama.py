"""``LlamaRunner``: a standard decoder as a ``ModelRunner`` (RMSNorm, RoPE, grouped-query
attention with fewer KV heads than query heads, SwiGLU MLP), Megatron tensor-parallel.

Rank r of tp holds ``heads // tp`` query heads and ``kv_heads // tp`` KV heads (the
pool's shard is exactly its KV heads), ``ffn // tp`` MLP units, and the matching columns
of o_proj and down_proj, whose products are summed over the group (two all-reduces per
layer). Weights come from a seed, or from safetensors files (``weights=``; a Hugging
Face ``config.json`` as ``config=`` gives the shape). ``llama_reference_logits`` is the
same model over a whole sequence at once, without any pool: what the cached path is
checked against. Shapes and weights: ``llama_weights``.

    GroupConfig(tp=2, **runner_options("tpcache.model.llama:LlamaRunner", [
        "config=/models/x/config.json", "weights=/models/x", "dtype=bfloat16"]))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tpcache.model.attention import attend, rms_norm, rotary
from tpcache.model.batch import RunnerBatch, paged_attention
from tpcache.model.llama_weights import LlamaSpec, load_shard
from tpcache.model.runner import (
    Collectives,
    KVShard,
    RankShard,
    RunnerOutput,
    ShardRunner,
    check_vocab,
    torch_dtype,
)

_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def _prepare(w: dict[str, torch.Tensor], dt: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Weights as the forward uses them: rounded to ``dt`` on ``device``, projections
    transposed to ``[in, out]`` (so ``x @ W``); the row-parallel ones then held in float32,
    as the float32 sums they feed are."""
    out = {}
    for name, t in w.items():
        t = t.to(device=device, dtype=dt)
        if t.dim() == 2 and not name.endswith("embed_tokens.weight"):
            t = t.t().contiguous()
        out[name] = t.float() if name.endswith(_ROW_PARALLEL) else t
    return out


def _head(spec: LlamaSpec, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The LM head ``[hidden, vocab]``: its own weight, or the embeddings' when tied."""
    if spec.tie_embeddings:
        return w["model.embed_tokens.weight"].t()
    return w["lm_head.weight"]


class LlamaRunner(ShardRunner):
    """One rank's shard of a ``LlamaSpec`` model. Arguments: ``dtype`` (weights,
    activations and KV), ``config`` (a Hugging Face config.json) and ``LlamaSpec``'s
    fields (``weights`` among them). Precision as the reference runner's: the residual
    stream and the all-reduced products in float32."""

    def __init__(self, dtype: str = "float32", config: str | None = None, **fields: Any) -> None:
        super().__init__(dtype)
        self.spec = LlamaSpec.from_args(config, **fields)
        self.q_heads = self.kv_heads = 0  # set by load()

    def load(self, shard: RankShard) -> None:
        spec = self.spec
        spec.check_tp(shard.tp)
        self.q_heads, self.kv_heads = spec.heads // shard.tp, spec.kv_heads // shard.tp
        self.w = _prepare(load_shard(spec, shard.rank, shard.tp), self.dtype, shard.device)

    def run(self, batch: RunnerBatch, kv: KVShard, group: Collectives) -> RunnerOutput:
        spec, w, dt = self.spec, self.w, self.dtype
        t, hd, theta = batch.num_tokens, spec.head_dim, spec.rope_theta
        pos = batch.positions
        x = w["model.embed_tokens.weight"][batch.tokens].float()  # residual: float32
        for i, where in enumerate(kv.placement):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], spec.eps).to(dt)
            q = (h @ w[p + "self_attn.q_proj.weight"]).view(t, self.q_heads, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"]).view(t, self.kv_heads, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"]).view(t, self.kv_heads, hd)
            q, k = rotary(q, pos, theta), rotary(k, pos, theta)
            a = paged_attention(batch, q, k, v, where.pool, where.window, kv.buffers(i))
            x = x + group.all_reduce_sum(a.float() @ w[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.eps).to(dt)
            x = x + group.all_reduce_sum(_swiglu(h, w, p).float() @ w[p + "mlp.down_proj.weight"])
        out = rms_norm(batch.output_rows(x), w["model.norm.weight"], spec.eps).to(dt)
        return RunnerOutput(logits=(out @ _head(spec, w)).float())


def _swiglu(h: torch.Tensor, w: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    return F.silu(h @ w[p + "mlp.gate_proj.weight"]) * (h @ w[p + "mlp.up_proj.weight"])


def llama_reference_logits(
    spec: LlamaSpec, tokens: torch.Tensor | list[int], dtype: str = "float32"
) -> torch.Tensor:
    """Full recompute without any cache: logits ``[T, vocab]`` (float32, CPU) of every
    position of ``tokens``, from the whole weights (TP=1), K and V of the whole sequence
    at once, causal and (for SWA layers) windowed masks, GQA by head groups. Same
    precision recipe as ``LlamaRunner``. Changes nothing."""
    dt = torch_dtype(dtype)
    w = _prepare(load_shard(spec, 0, 1), dt, "cpu")
    toks = torch.as_tensor(tokens, dtype=torch.int64)
    t, hd = int(toks.numel()), spec.head_dim
    check_vocab(toks, spec.vocab)
    pos = torch.arange(t)
    x = w["model.embed_tokens.weight"][toks].float()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        window = spec.window if i in spec.swa_layers else None
        h = rms_norm(x, w[p + "input_layernorm.weight"], spec.eps).to(dt)
        q = rotary(
            (h @ w[p + "self_attn.q_proj.weight"]).view(t, spec.heads, hd), pos, spec.rope_theta
        )
        k = rotary(
            (h @ w[p + "self_attn.k_proj.weight"]).view(t, spec.kv_heads, hd), pos, spec.rope_theta
        )
        v = (h @ w[p + "self_attn.v_proj.weight"]).view(t, spec.kv_heads, hd)
        a = attend(q, k, v, pos, pos, window)
        x = x + a.float() @ w[p + "self_attn.o_proj.weight"]
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.eps).to(dt)
        x = x + _swiglu(h, w, p).float() @ w[p + "mlp.down_proj.weight"]
    out = rms_norm(x, w["model.norm.weight"], spec.eps).to(dt)
    return (out @ _head(spec, w)).float()


class LlamaReference:
    """What ``modelcheck`` compares a ``LlamaRunner`` against (its ``Reference``)."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.spec = spec
        self.vocab = spec.vocab

    def full_logits(self, tokens: list[int], dtype: str) -> np.ndarray:
        return llama_reference_logits(self.spec, tokens, dtype).numpy()


__all__ = ["LlamaReference", "LlamaRunner", "LlamaSpec", "llama_reference_logits"]
