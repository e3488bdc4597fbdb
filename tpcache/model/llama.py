"""``LlamaRunner``: a Llama-family decoder as a ``ModelRunner`` (RMSNorm, RoPE, grouped-query
attention with fewer KV heads than query heads, SwiGLU MLP), Megatron tensor-parallel.

Rank r of tp holds ``heads // tp`` query heads and ``kv_heads // tp`` KV heads (the
pool's shard is exactly its KV heads; with fewer KV heads than ranks, a copy of the one
its query heads use), ``ffn // tp`` MLP units, and the matching columns of o_proj and
down_proj, whose products are summed over the group (two all-reduces per layer).
Weights come from a seed, or from a Hugging Face checkpoint: ``model=DIR`` (its
config.json and safetensors, sharded or not), or ``config=`` and ``weights=`` apart.
Llama (2, 3.x with llama3 RoPE scaling and tied embeddings), Mistral (with or without
its sliding window), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) load
exactly; anything else is refused by name (``llama_weights``, ``hf_config``).
``llama_reference_logits`` is the same model over a whole sequence at once, without any
pool: what the cached path is checked against (tests check both against transformers).

    GroupConfig(tp=2, **runner_options("tpcache.model.llama:LlamaRunner", [
        "model=/models/x", "dtype=bfloat16"]))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tpcache.model.attention import attend, rms_norm, rotary_freqs
from tpcache.model.batch import RunnerBatch, paged_attention
from tpcache.model.errors import RunnerConfigError
from tpcache.model.hf_config import HFConfig, read_hf_config
from tpcache.model.llama_weights import LlamaSpec, check_checkpoint, load_shard
from tpcache.model.rope import rope_inv_freq
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


def _inv_freq(spec: LlamaSpec) -> torch.Tensor:
    return torch.tensor(
        rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling), dtype=torch.float64
    )


def _qkv(
    spec: LlamaSpec, w: dict[str, torch.Tensor], p: str, h: torch.Tensor, heads: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``p``'s queries, keys and values ``[t, heads, head_dim]`` for ``heads`` (query
    and KV heads held here): projections, their biases, Qwen3's per-head norms. Before
    RoPE. A bias is added in the product's dtype, as a biased Linear does."""
    t, hd = h.shape[0], spec.head_dim
    out = []
    for part, n in zip(("q", "k", "v"), (heads[0], heads[1], heads[1]), strict=True):
        x = h @ w[f"{p}self_attn.{part}_proj.weight"]
        if spec.qkv_bias:
            x = x + w[f"{p}self_attn.{part}_proj.bias"]
        x = x.view(t, n, hd)
        if spec.qk_norm and part != "v":
            x = rms_norm(x, w[f"{p}self_attn.{part}_norm.weight"], spec.eps)
        out.append(x)
    return out[0], out[1], out[2]


def _o_bias(spec: LlamaSpec, w: dict[str, torch.Tensor], p: str) -> torch.Tensor | float:
    """o_proj's bias (added once, after the sum over ranks), or nothing."""
    return w[p + "self_attn.o_proj.bias"].float() if spec.o_bias else 0.0


class LlamaRunner(ShardRunner):
    """One rank's shard of a ``LlamaSpec`` model. Arguments: ``dtype`` (weights,
    activations and KV), ``model`` (a Hugging Face model directory) or ``config`` (its
    config.json), and ``LlamaSpec``'s fields (``weights`` among them). The constructor
    reads the config and the checkpoint's headers (cheap) and raises their typed errors,
    so a coordinator refuses a bad checkpoint before any rank starts; ``load`` checks
    again on its rank before reading. ``config``: the parsed ``HFConfig`` (vocabulary,
    ``eos_token_ids``), None for a drawn model. Precision as the reference runner's:
    the residual stream and the all-reduced products in float32."""

    def __init__(
        self, dtype: str = "float32", config: str | None = None, model: str | None = None,
        **fields: Any,
    ) -> None:  # fmt: skip
        super().__init__(dtype)
        if model is not None and (config is not None or "weights" in fields):
            raise RunnerConfigError(
                "model= gives the config and the weights: drop config=/weights="
            )
        source = model if model is not None else config
        self.config: HFConfig | None = read_hf_config(source) if source is not None else None
        weights = {"weights": str(model)} if model is not None else {}
        self.spec = LlamaSpec.from_args(self.config, **fields, **weights)
        check_checkpoint(self.spec)
        self.q_heads = self.kv_heads = 0  # set by load()
        self.inv_freq = _inv_freq(self.spec)

    def load(self, shard: RankShard) -> None:
        spec = self.spec
        spec.check_tp(shard.tp)
        self.q_heads, self.kv_heads = spec.heads // shard.tp, spec.kv_heads_per_rank(shard.tp)
        self.w = _prepare(load_shard(spec, shard.rank, shard.tp), self.dtype, shard.device)
        self.inv_freq = self.inv_freq.to(shard.device)

    def run(self, batch: RunnerBatch, kv: KVShard, group: Collectives) -> RunnerOutput:
        spec, w, dt = self.spec, self.w, self.dtype
        pos = batch.positions
        x = w["model.embed_tokens.weight"][batch.tokens].float()  # residual: float32
        for i, where in enumerate(kv.placement):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], spec.eps).to(dt)
            q, k, v = _qkv(spec, w, p, h, (self.q_heads, self.kv_heads))
            q, k = rotary_freqs(q, pos, self.inv_freq), rotary_freqs(k, pos, self.inv_freq)
            a = paged_attention(batch, q, k, v, where.pool, where.window, kv.buffers(i))
            x = x + group.all_reduce_sum(a.float() @ w[p + "self_attn.o_proj.weight"])
            x = x + _o_bias(spec, w, p)
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
    t = int(toks.numel())
    check_vocab(toks, spec.vocab)
    pos, inv = torch.arange(t), _inv_freq(spec)
    x = w["model.embed_tokens.weight"][toks].float()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        window = spec.window if i in spec.swa_layers else None
        h = rms_norm(x, w[p + "input_layernorm.weight"], spec.eps).to(dt)
        q, k, v = _qkv(spec, w, p, h, (spec.heads, spec.kv_heads))
        a = attend(rotary_freqs(q, pos, inv), rotary_freqs(k, pos, inv), v, pos, pos, window)
        x = x + a.float() @ w[p + "self_attn.o_proj.weight"] + _o_bias(spec, w, p)
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
