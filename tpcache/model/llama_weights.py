"""The shape of a standard (Llama-style) decoder and where its weights come from: drawn
from a seed, or read from safetensors files with Hugging Face names. Each rank reads only
its Megatron shard (rows or columns of each split weight), straight from the file map.

Weights use Hugging Face's names and ``[out, in]`` layout (``model.layers.{i}.self_attn
.q_proj.weight`` ...), so a Llama, Mistral-style or Qwen3-style checkpoint without biases
or RoPE scaling loads as it is. Rotary positions use the rotate-half layout those
checkpoints are stored for.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from tpcache.kv.pool import check_positive_int
from tpcache.model.runner import KVLayout, RunnerConfigError
from tpcache.model.safetensors_io import SafeFile, iter_tensors, safetensors_files

_IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


@dataclass(frozen=True)
class LlamaSpec:
    """A decoder: ``num_layers`` blocks of RMSNorm, grouped-query attention (``heads``
    query heads sharing ``kv_heads`` KV heads of ``head_dim``) with RoPE, RMSNorm and a
    SwiGLU MLP of ``ffn`` units. ``weights``: a safetensors file, or a directory of them
    (None: random weights drawn from ``seed``). ``swa_layers`` attend over a sliding
    ``window`` of tokens before the current one."""

    vocab: int = 128
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 128
    num_layers: int = 2
    swa_layers: tuple[int, ...] = ()
    window: int | None = None
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tie_embeddings: bool = False
    seed: int = 0
    weights: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "heads", "ffn"):
            check_positive_int(name, getattr(self, name), RunnerConfigError)
        self.layout("float32")  # layers, KV heads, head_dim, window
        if self.head_dim % 2:
            raise RunnerConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.heads % self.kv_heads:
            raise RunnerConfigError(
                f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}"
            )

    @classmethod
    def from_args(cls, config: str | None = None, **args: Any) -> LlamaSpec:
        """A spec from a Hugging Face ``config.json`` (``config``), then ``args`` on top
        (lists become tuples). Raises RunnerConfigError for an unknown argument or a
        config this model cannot run."""
        known = {f.name for f in fields(cls)}
        base = hf_config(config) if config is not None else {}
        unknown = sorted(set(args) - known)
        if unknown:
            raise RunnerConfigError(
                f"unknown LlamaSpec arguments {unknown}; known: {sorted(known)}"
            )
        merged = {**base, **args}
        if isinstance(merged.get("swa_layers"), list | tuple):
            merged["swa_layers"] = tuple(merged["swa_layers"])
        return cls(**merged)

    def layout(self, dtype: str) -> KVLayout:
        return KVLayout(
            self.num_layers, self.kv_heads, self.head_dim, dtype, self.swa_layers, self.window
        )

    def check_tp(self, tp: int) -> None:
        """Raises RunnerConfigError unless query heads, KV heads and MLP units split evenly."""
        if self.heads % tp or self.kv_heads % tp or self.ffn % tp:
            raise RunnerConfigError(
                f"heads={self.heads}, kv_heads={self.kv_heads} and ffn={self.ffn} must all "
                f"divide by tp={tp}"
            )


def hf_config(path: str) -> dict[str, Any]:
    """``LlamaSpec`` fields from a Hugging Face ``config.json``. Raises RunnerConfigError
    for what this model does not do (RoPE scaling, attention or MLP biases)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RunnerConfigError(f"cannot read the model config {path}: {exc}") from None
    if cfg.get("rope_scaling") or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise RunnerConfigError(f"{path}: RoPE scaling and biases are not supported")
    heads = cfg["num_attention_heads"]
    return {
        "vocab": cfg["vocab_size"],
        "hidden": cfg["hidden_size"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "ffn": cfg["intermediate_size"],
        "num_layers": cfg["num_hidden_layers"],
        "rope_theta": float(cfg.get("rope_theta", 10000.0)),
        "eps": float(cfg.get("rms_norm_eps", 1e-5)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def weight_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every weight's name and full shape (``[out, in]``), in drawing order."""
    d, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, d)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "self_attn.q_proj.weight"] = (q, d)
        out[p + "self_attn.k_proj.weight"] = (kv, d)
        out[p + "self_attn.v_proj.weight"] = (kv, d)
        out[p + "self_attn.o_proj.weight"] = (d, q)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (spec.ffn, d)
        out[p + "mlp.up_proj.weight"] = (spec.ffn, d)
        out[p + "mlp.down_proj.weight"] = (d, spec.ffn)
    out["model.norm.weight"] = (d,)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (spec.vocab, d)
    return out


@functools.lru_cache(maxsize=4)
def random_weights(spec: LlamaSpec) -> dict[str, torch.Tensor]:
    """The whole model's weights (float32, CPU) drawn from ``spec.seed`` in a fixed order:
    bit-identical in every process. Read-only by contract."""
    g = torch.Generator().manual_seed(spec.seed)
    out = {}
    for name, shape in weight_shapes(spec).items():
        if len(shape) == 1:  # a norm's gain, near 1
            t = 1.0 + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.1
        else:  # fan-in scaled, so activations stay O(1) through the layers
            t = torch.randn(*shape, generator=g, dtype=torch.float64) * shape[1] ** -0.5
        out[name] = t.float()
    return out


Slice = tuple[slice | None, slice | None]


def shard_slices(spec: LlamaSpec, rank: int, tp: int) -> Callable[[str], Slice]:
    """Which rows and columns of each weight rank ``rank`` holds (Megatron): its query
    heads' and KV heads' rows of q/k/v, its MLP units' rows of gate/up (column-parallel
    products), the matching columns of o and down (row-parallel, summed over ranks);
    the rest whole. A query head's KV head stays on its rank: heads and kv_heads both
    divide by tp, so rank r's query heads use exactly rank r's KV heads."""
    spec.check_tp(tp)
    hd = spec.head_dim
    q = slice(rank * spec.heads // tp * hd, (rank + 1) * spec.heads // tp * hd)
    kv = slice(rank * spec.kv_heads // tp * hd, (rank + 1) * spec.kv_heads // tp * hd)
    units = slice(rank * spec.ffn // tp, (rank + 1) * spec.ffn // tp)
    by_part: dict[str, Slice] = {
        "q_proj": (q, None),
        "k_proj": (kv, None),
        "v_proj": (kv, None),
        "o_proj": (None, q),
        "gate_proj": (units, None),
        "up_proj": (units, None),
        "down_proj": (None, units),
    }
    return lambda name: by_part.get(name.split(".")[-2], (None, None))


def load_shard(spec: LlamaSpec, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of every weight (stored dtype for files, float32 drawn).
    Raises RunnerConfigError / SafetensorsError for a file that lacks a weight, holds one
    of another shape, or holds one this model does not use (a bias: it would be wrong
    to drop it)."""
    cut = shard_slices(spec, rank, tp)
    shapes = weight_shapes(spec)
    if spec.weights is None:
        full = random_weights(spec)
        return {n: _take(full[n], *cut(n)).contiguous() for n in shapes}
    files = safetensors_files(spec.weights)
    where: dict[str, SafeFile] = {}
    opened: list[SafeFile] = []
    try:
        for name, f in iter_tensors(files):
            if not opened or opened[-1] is not f:
                opened.append(f)
            where[name] = f
        extra = sorted(n for n in where if n not in shapes and not n.endswith(_IGNORED))
        if extra:
            raise RunnerConfigError(f"{spec.weights}: weights this model does not use: {extra[:5]}")
        out = {}
        for name, shape in shapes.items():
            if name not in where:
                raise RunnerConfigError(f"{spec.weights}: no weight {name!r}")
            if where[name].shape(name) != shape:
                raise RunnerConfigError(
                    f"{spec.weights}: {name} is {where[name].shape(name)}, the spec says {shape}"
                )
            out[name] = where[name].get(name, *cut(name))
        return out
    finally:
        for f in opened:
            f.close()


def _take(t: torch.Tensor, rows: slice | None, cols: slice | None) -> torch.Tensor:
    if rows is None and cols is None:
        return t
    return t[rows or slice(None), cols or slice(None)]


__all__ = ["LlamaSpec", "hf_config", "load_shard", "random_weights", "weight_shapes"]
