"""A Hugging Face ``config.json`` read strictly: what a Llama-family checkpoint computes, or
a typed refusal that names the key.

Families: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, as transformers 4.x writes them
(``rope_theta`` and ``rope_scaling`` at the top level) and as 5.x does (``rope_parameters``
with ``rope_type`` and ``rope_theta``). RoPE types: ``default``, ``linear`` and ``llama3``.
Sliding windows as transformers 5 applies them: Mistral's ``sliding_window`` on every
layer; Qwen's ``use_sliding_window`` on the ``layer_types`` marked sliding (or the layers
from ``max_window_layers`` on). Every key is either used, or listed in ``HARMLESS`` (it
does not change what inference computes), or accepted only with the value that
computes the same as without it (no MLP bias, ``silu``); anything else, an unknown key
above all, raises a ``ConfigKeyError`` naming it: a model must load exactly right or
not at all.

Torch-free, so a front end can read a model's vocabulary and end-of-sequence ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpcache.model.errors import (
    MissingConfigKey,
    RunnerConfigError,
    UnknownConfigKey,
    UnsupportedConfig,
)
from tpcache.model.rope import RopeScaling, parse_rope

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Keys that do not change what a forward computes (training, generation defaults,
# bookkeeping). max_position_embeddings is kept as ``max_positions`` for an engine.
HARMLESS = frozenset({
    "_from_model_config", "_name_or_path", "architectures", "attention_dropout",
    "bos_token_id", "chunk_size_feed_forward", "dtype", "id2label", "initializer_range",
    "is_encoder_decoder", "label2id", "output_attentions", "output_hidden_states",
    "pad_token_id", "pretraining_tp", "problem_type", "return_dict", "tokenizer_class",
    "torch_dtype", "transformers_version", "use_cache",
})  # fmt: skip

_USED = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "eos_token_id",
    "max_position_embeddings", "layer_types",
})  # fmt: skip

# Keys each family has beyond the shared ones (checked for their value below).
_FAMILY_KEYS = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"sliding_window", "use_sliding_window", "max_window_layers"}),
    "qwen3": frozenset(
        {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers"}
    ),
}

# Why some keys seen in other checkpoints are refused (the rest: "not a key it knows").
_REASONS = {
    "num_experts": "a mixture of experts",
    "num_local_experts": "a mixture of experts",
    "num_experts_per_tok": "a mixture of experts",
    "quantization_config": "quantized weights",
    "auto_map": "custom model code",
    "partial_rotary_factor": "rotary positions on part of each head",
}


@dataclass(frozen=True)
class HFConfig:
    """What a checkpoint's config says the model computes. ``qkv_bias``: q/k/v
    projections carry biases (Qwen2 always, ``attention_bias`` otherwise); ``o_bias``: so
    does o_proj; ``qk_norm``: per-head RMSNorm of queries and keys before RoPE (Qwen3).
    ``swa_layers`` attend over the ``window`` tokens before the current one (one less
    than transformers' ``sliding_window``, which counts the current token).
    ``eos_token_ids``: from config.json, then generation_config.json beside it."""

    model_type: str
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    num_layers: int
    eps: float
    tie_embeddings: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    swa_layers: tuple[int, ...] = ()
    window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_positions: int | None = None

    def spec_fields(self) -> dict[str, Any]:
        """The fields of a ``LlamaSpec`` with this shape."""
        names = (
            "vocab", "hidden", "heads", "kv_heads", "head_dim", "ffn", "num_layers", "eps",
            "tie_embeddings", "rope_theta", "rope_scaling", "qkv_bias", "o_bias", "qk_norm",
            "swa_layers", "window",
        )  # fmt: skip
        return {n: getattr(self, n) for n in names}


def config_path(path: str | Path) -> Path:
    """``path`` itself, or its ``config.json`` when it is a directory."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_hf_config(path: str | Path) -> HFConfig:
    """Parse ``path`` (a config.json, or the model directory holding it) strictly. Raises
    RunnerConfigError if it cannot be read, ConfigKeyError (UnknownConfigKey,
    UnsupportedConfig, MissingConfigKey) naming the key that stops it."""
    p = config_path(path)
    cfg = _read_json(p)
    where = str(p)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedConfig(where, "model_type", f"is {kind!r}; this runner loads {FAMILIES}")
    known = _USED | HARMLESS | _FAMILY_KEYS[kind]
    for key in cfg:
        if key not in known:
            why = _REASONS.get(key, f"is not a key this runner knows for {kind!r}")
            raise UnknownConfigKey(where, key, f"{why}: it may change the computation")
    get = _Getter(cfg, where)
    if get.value("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(where, "hidden_act", f"is {cfg['hidden_act']!r}; only 'silu' runs")
    if get.value("mlp_bias", False) is not False:
        raise UnsupportedConfig(where, "mlp_bias", "is set: MLP biases are not computed")
    num_layers = get.positive("num_hidden_layers")
    swa_layers, window = _sliding(cfg, kind, num_layers, where)
    heads, hidden = get.positive("num_attention_heads"), get.positive("hidden_size")
    kv_heads = get.positive("num_key_value_heads") if _given(cfg, "num_key_value_heads") else heads
    if heads % kv_heads:
        raise UnsupportedConfig(
            where, "num_key_value_heads", f"is {kv_heads}; it must divide the {heads} query heads"
        )
    if _given(cfg, "head_dim"):
        head_dim = get.positive("head_dim")
    else:  # transformers' own defaults
        head_dim = 128 if kind == "qwen3" else hidden // heads
    attention_bias = get.flag("attention_bias") if kind in ("llama", "qwen3") else False
    theta, scaling = parse_rope(cfg, where)
    return HFConfig(
        model_type=kind,
        vocab=get.positive("vocab_size"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=get.positive("intermediate_size"),
        num_layers=num_layers,
        eps=get.number("rms_norm_eps", 1e-6),
        tie_embeddings=get.flag("tie_word_embeddings"),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=kind == "qwen2" or attention_bias,
        o_bias=attention_bias,
        qk_norm=kind == "qwen3",
        swa_layers=swa_layers,
        window=window,
        eos_token_ids=_eos_ids(cfg, p),
        max_positions=cfg.get("max_position_embeddings"),
    )


def _given(cfg: dict[str, Any], key: str) -> bool:
    return cfg.get(key) is not None


class _Getter:
    """Typed reads of one config's keys; errors name the key."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def value(self, key: str, default: Any) -> Any:
        v = self.cfg.get(key)
        return default if v is None else v

    def positive(self, key: str) -> int:
        v = self.cfg.get(key)
        if v is None:
            raise MissingConfigKey(self.where, key, "is needed for the model's shape")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UnsupportedConfig(self.where, key, f"is {v!r}; a positive integer is needed")
        return v

    def number(self, key: str, default: float) -> float:
        v = self.value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise UnsupportedConfig(self.where, key, f"is {v!r}; a positive number is needed")
        return float(v)

    def flag(self, key: str) -> bool:
        v = self.value(key, False)
        if not isinstance(v, bool):
            raise UnsupportedConfig(self.where, key, f"is {v!r}; true or false is needed")
        return v


def _sliding(
    cfg: dict[str, Any], kind: str, num_layers: int, where: str
) -> tuple[tuple[int, ...], int | None]:
    """The layers that attend over a sliding window, and the window in this runner's terms
    (the tokens before the current one seen: transformers' ``sliding_window`` counts the
    current one too). Mistral: every layer, when ``sliding_window`` is set. Qwen2/Qwen3:
    with ``use_sliding_window``, the ``layer_types`` marked sliding (else the layers from
    ``max_window_layers`` on), as transformers 5 does; without it, every layer is full
    and ``layer_types`` must say so."""
    types = cfg.get("layer_types")
    if types is not None and (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in ("full_attention", "sliding_attention") for t in types)
    ):
        raise UnsupportedConfig(where, "layer_types", f"is {types!r}: not one type per layer")
    window = cfg.get("sliding_window")
    if kind == "mistral":
        if types is not None:
            raise UnsupportedConfig(where, "layer_types", "is not a Mistral key: it is ambiguous")
        layers = tuple(range(num_layers)) if window is not None else ()
    elif cfg.get("use_sliding_window") is True and window is not None:
        first = cfg.get("max_window_layers", 28)  # transformers' default
        if types is None and (isinstance(first, bool) or not isinstance(first, int)):
            raise UnsupportedConfig(where, "max_window_layers", f"is {first!r}; a count is needed")
        layers = tuple(
            i
            for i in range(num_layers)
            if (types[i] == "sliding_attention" if types is not None else i >= first)
        )
    else:
        if cfg.get("use_sliding_window"):
            raise UnsupportedConfig(where, "use_sliding_window", "is set without a sliding_window")
        if types is not None and "sliding_attention" in types:
            raise UnsupportedConfig(
                where, "layer_types", "has sliding layers but use_sliding_window is not set"
            )
        layers = ()
    if not layers:
        return (), None
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise UnsupportedConfig(where, "sliding_window", f"is {window!r}; at least 2 is needed")
    return layers, window - 1


def _eos_ids(cfg: dict[str, Any], config: Path) -> tuple[int, ...]:
    """End-of-sequence ids of config.json, then of generation_config.json (if there)."""
    found: list[int] = []
    sources = [(config, cfg.get("eos_token_id"))]
    generation = config.parent / "generation_config.json"
    if generation.is_file():
        sources.append((generation, _read_json(generation).get("eos_token_id")))
    for path, v in sources:
        for i in v if isinstance(v, list) else [] if v is None else [v]:
            if isinstance(i, bool) or not isinstance(i, int):
                raise UnsupportedConfig(str(path), "eos_token_id", f"holds {i!r}")
            if i not in found:
                found.append(i)
    return tuple(found)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunnerConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise RunnerConfigError(f"{path} is not a JSON object")
    return data


__all__ = [
    "HARMLESS",
    "HFConfig",
    "config_path",
    "read_hf_config",
]
