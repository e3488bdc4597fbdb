"""Rotary positions as Hugging Face configs describe them: the base (``rope_theta``) and
the scaling (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4.x), parsed
strictly, and the inverse frequencies they give. Torch-free.

Types that load: ``default``, ``linear`` and ``llama3``; the others (``dynamic``, whose
frequencies depend on the sequence length, ``yarn``, ``longrope`` ...) are refused by
name, as is any parameter a type does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tpcache.model.errors import MissingConfigKey, UnknownConfigKey, UnsupportedConfig

_ROPE_KEYS = {  # each RoPE type's parameters beyond rope_type and rope_theta
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequencies rescaled for long context: ``linear`` (every inverse frequency
    divided by ``factor``) or ``llama3`` (low frequencies divided by ``factor``, high
    ones kept, the band between interpolated, with wavelength bounds from
    ``original_max_positions`` over ``low_freq_factor`` and ``high_freq_factor``)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> list[float]:
    """The ``head_dim // 2`` inverse frequencies of rotate-half RoPE, in float64."""
    inv = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return [f / scaling.factor for f in inv]
    s = scaling
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:  # between the two: interpolated
            smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


def parse_rope(cfg: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling, from ``rope_parameters`` (transformers 5) or the
    top-level ``rope_theta`` and ``rope_scaling`` (4.x)."""
    params, legacy = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if params is not None and legacy is not None and params != legacy:
        raise UnsupportedConfig(where, "rope_scaling", "disagrees with 'rope_parameters'")
    key = "rope_parameters" if params is not None else "rope_scaling"
    raw = params if params is not None else legacy or {}
    if not isinstance(raw, dict):
        raise UnsupportedConfig(where, key, f"is {raw!r}; an object is needed")
    p = dict(raw)
    kind, old_kind = p.pop("rope_type", None), p.pop("type", None)
    if kind is not None and old_kind is not None and kind != old_kind:
        raise UnsupportedConfig(where, f"{key}.type", f"is {old_kind!r}, rope_type {kind!r}")
    kind = kind or old_kind or "default"
    if kind not in _ROPE_KEYS:
        raise UnsupportedConfig(
            where, f"{key}.rope_type", f"is {kind!r}; RoPE types that load: {sorted(_ROPE_KEYS)}"
        )
    theta, top = p.pop("rope_theta", None), cfg.get("rope_theta")
    if theta is not None and top is not None and float(theta) != float(top):
        raise UnsupportedConfig(where, "rope_theta", f"is {top}, {key}.rope_theta {theta}")
    theta = float(theta if theta is not None else top if top is not None else 10000.0)
    if p.pop("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfig(where, f"{key}.partial_rotary_factor", "is not 1")
    for name in p:
        if name not in _ROPE_KEYS[kind]:
            raise UnknownConfigKey(where, f"{key}.{name}", f"is not a {kind!r} RoPE parameter")
    for name in _ROPE_KEYS[kind]:
        if not isinstance(p.get(name), int | float) or isinstance(p[name], bool):
            raise MissingConfigKey(where, f"{key}.{name}", f"is needed by {kind!r} RoPE")
    if kind == "default":
        return theta, None
    return theta, RopeScaling(
        kind,
        float(p["factor"]),
        float(p.get("low_freq_factor", 1.0)),
        float(p.get("high_freq_factor", 4.0)),
        int(p.get("original_max_position_embeddings", 8192)),
    )


__all__ = ["RopeScaling", "parse_rope", "rope_inv_freq"]
