"""The shape of a standard (Llama-family) decoder and where its weights come from: drawn
from a seed, or read from a Hugging Face checkpoint. Each rank reads only its Megatron
shard (rows or columns of each split weight) through ``safetensors``' slices.

What loads: ``model_type`` llama, mistral, qwen2 and qwen3, configs of transformers 4.x
or 5.x (``hf_config`` reads them strictly), RoPE default, linear or llama3, tied or own
LM head, q/k/v (and o) biases, Qwen3's per-head q/k RMSNorm, Mistral's and Qwen's
sliding windows, fewer KV heads than ranks (copied), safetensors in float32,
float16 or bfloat16, one file or sharded with an index (``checkpoint``). Weights use
Hugging Face's names and ``[out, in]`` layout; rotary positions use the rotate-half
layout those checkpoints are stored for. Anything else is refused by name, before any
rank computes: a missing, extra or misshapen tensor, a truncated file, a config key that
would change the computation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from tpcache.kv.pool import check_positive_int
from tpcache.model.checkpoint import Slice, TensorInfo, check_tensors, read_tensors, scan
from tpcache.model.errors import UnexpectedTensor
from tpcache.model.hf_config import HFConfig, read_hf_config
from tpcache.model.rope import RopeScaling
from tpcache.model.runner import KVLayout, RunnerConfigError

_HARMLESS = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


@dataclass(frozen=True)
class LlamaSpec:
    """A decoder: ``num_layers`` blocks of RMSNorm, grouped-query attention (``heads``
    query heads sharing ``kv_heads`` KV heads of ``head_dim``) with RoPE, RMSNorm and a
    SwiGLU MLP of ``ffn`` units. ``weights``: a safetensors file, or a directory of them
    (None: random weights drawn from ``seed``). ``swa_layers`` attend over a sliding
    ``window`` of tokens before the current one (a checkpoint's, from its config)."""

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
    rope_scaling: RopeScaling | None = None
    eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections carry biases
    o_bias: bool = False  # so does o_proj
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
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
    def from_args(
        cls, config: str | HFConfig | None = None, model: str | None = None, **args: Any
    ) -> LlamaSpec:
        """A spec from a Hugging Face model directory (``model``: its config.json and its
        weights) or ``config`` (a config.json, or one already read), then ``args`` on top
        (lists become tuples). Raises RunnerConfigError (ConfigKeyError naming the key)
        for an unknown argument or a config this model cannot run exactly."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise RunnerConfigError(
                f"unknown LlamaSpec arguments {unknown}; known: {sorted(known)}"
            )
        if model is not None:
            if config is not None or "weights" in args:
                raise RunnerConfigError(
                    "model= gives the config and the weights: drop config=/weights="
                )
            config, args = str(Path(model) / "config.json"), {**args, "weights": str(model)}
        if isinstance(config, str):
            config = read_hf_config(config)
        merged = {**(config.spec_fields() if config is not None else {}), **args}
        if isinstance(merged.get("swa_layers"), list | tuple):
            merged["swa_layers"] = tuple(merged["swa_layers"])
        return cls(**merged)

    def layout(self, dtype: str) -> KVLayout:
        return KVLayout(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            dtype,
            self.swa_layers,
            self.window,
            replicate_kv=True,
        )

    def check_tp(self, tp: int) -> None:
        """Raises RunnerConfigError unless query heads, KV heads and MLP units split evenly
        over ``tp`` ranks. Fewer KV heads than ranks split too when tp is a multiple of
        them: each rank then holds a copy of the KV head its query heads use."""
        kv_split = self.kv_heads % tp == 0 or tp % self.kv_heads == 0
        if self.heads % tp or not kv_split or self.ffn % tp:
            raise RunnerConfigError(
                f"heads={self.heads} and ffn={self.ffn} must divide by tp={tp}, and "
                f"kv_heads={self.kv_heads} divide it or be divided by it"
            )

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(self.kv_heads // tp, 1)


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
        if spec.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if spec.o_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
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
        if name.endswith(".bias"):
            t = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.1
        elif len(shape) == 1:  # a norm's gain, near 1
            t = 1.0 + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.1
        else:  # fan-in scaled, so activations stay O(1) through the layers
            t = torch.randn(*shape, generator=g, dtype=torch.float64) * shape[1] ** -0.5
        out[name] = t.float()
    return out


def shard_slices(spec: LlamaSpec, rank: int, tp: int) -> Callable[[str], Slice]:
    """Which rows and columns of each weight rank ``rank`` holds (Megatron): its query
    heads' and KV heads' rows of q/k/v, its MLP units' rows of gate/up (column-parallel
    products), the matching columns of o and down (row-parallel, summed over ranks);
    the rest whole. A query head's KV head stays on its rank: heads and kv_heads both
    divide by tp, so rank r's query heads use exactly rank r's KV heads; with fewer KV
    heads than ranks, rank r's query heads all use KV head ``r * kv_heads // tp``, which
    it holds a copy of."""
    spec.check_tp(tp)
    hd = spec.head_dim
    q = slice(rank * spec.heads // tp * hd, (rank + 1) * spec.heads // tp * hd)
    first_kv = rank * spec.kv_heads // tp  # with fewer KV heads than ranks: rank's copy
    kv = slice(first_kv * hd, (first_kv + spec.kv_heads_per_rank(tp)) * hd)
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

    def cut(name: str) -> Slice:
        rows, cols = by_part.get(name.split(".")[-2], (None, None))
        # a bias follows its weight's rows; a row-parallel product's is added whole
        return (rows, None) if name.endswith(".bias") else (rows, cols)

    return cut


_HEAD = "lm_head.weight"


def _stored_shapes(spec: LlamaSpec, found: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    """The tensors the checkpoint must hold: the model's, and with tied embeddings an
    ``lm_head.weight`` if the file has one (some exports keep it; ``load_shard`` then
    requires it to equal the embeddings, which is what transformers computes with)."""
    shapes = weight_shapes(spec)
    if spec.tie_embeddings and _HEAD in found:
        shapes[_HEAD] = (spec.vocab, spec.hidden)
    return shapes


def check_checkpoint(spec: LlamaSpec) -> None:
    """Raise unless ``spec.weights`` holds exactly the model's tensors, with its shapes,
    in files whose headers are whole (headers only: cheap). RunnerConfigError kinds
    (UnreadableCheckpoint, MissingTensor, UnexpectedTensor, TensorShapeError,
    TensorDtypeError) name the file and the tensor."""
    if spec.weights is not None:
        found = scan(spec.weights)
        check_tensors(spec.weights, found, _stored_shapes(spec, found), _HARMLESS)


def load_shard(spec: LlamaSpec, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of every weight (stored dtype for files, float32 drawn).
    Every file's header is checked before any tensor is read (``check_checkpoint``'s
    errors); not a collective, so a refusal reaches every rank alike. Raises
    UnexpectedTensor for a stored LM head that differs from tied embeddings."""
    cut = shard_slices(spec, rank, tp)
    shapes = weight_shapes(spec)
    if spec.weights is None:
        full = random_weights(spec)
        return {n: _take(full[n], *cut(n)).contiguous() for n in shapes}
    found = scan(spec.weights)
    stored = _stored_shapes(spec, found)
    check_tensors(spec.weights, found, stored, _HARMLESS)
    out = read_tensors(found, stored, cut)
    head = out.pop(_HEAD, None) if spec.tie_embeddings else None
    if head is not None and not torch.equal(head, out["model.embed_tokens.weight"]):
        raise UnexpectedTensor(
            str(found[_HEAD].file), _HEAD, "differs from the embeddings it is tied to"
        )
    return out


def _take(t: torch.Tensor, rows: slice | None, cols: slice | None) -> torch.Tensor:
    if rows is None and cols is None:
        return t
    if t.dim() == 1:
        return t[rows]
    return t[rows or slice(None), cols or slice(None)]


__all__ = [
    "LlamaSpec",
    "check_checkpoint",
    "load_shard",
    "random_weights",
    "shard_slices",
    "weight_shapes",
]
