"""The math of one attention layer that both the pool path and the reference share.

Only what is not about the cache lives here: RMS norm, rotary positions, and masked
attention of queries over keys and values at known positions. Where K and V come from
(a pool read by slot ids, or the whole sequence computed at once) is the caller's
business, so the reference and the cached path cannot agree by sharing a bug in it.
Everything is vectorised over tokens and heads; nothing loops over tokens in Python.
"""

from __future__ import annotations

import torch

from tpcache.errors import TpcacheError


class AttentionError(TpcacheError, ValueError):
    """Shapes attention cannot take (heads that do not share KV heads evenly, a query
    with no key in its context)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in float32, cast back."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by its absolute ``positions`` (RoPE,
    rotate-half layout, inverse frequencies ``base ** (-2i / head_dim)``)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(d // 2, dtype=torch.float64, device=x.device) * 2 / d)
    return rotary_freqs(x, positions, inv)


def rotary_freqs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``rotary`` with the ``head_dim // 2`` inverse frequencies given (scaled RoPE).
    Angles in float64 so every position is exact; result in x's dtype."""
    half = x.shape[-1] // 2
    inv = inv_freq.to(device=x.device, dtype=torch.float64)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [tokens, half]
    cos = torch.cos(ang).float()[:, None, :]
    sin = torch.sin(ang).float()[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Causal (and, with ``window``, sliding-window) attention.

    ``q`` ``[n, heads, d]`` at positions ``q_pos``; ``k``/``v`` ``[c, kv_heads, d]`` at
    ``k_pos``. Grouped-query attention when ``kv_heads < heads``: query head h uses KV
    head ``h // (heads // kv_heads)``. A query at position p sees keys at positions
    ``k <= p`` and, with a window W, ``k >= p - W`` (W tokens before it and itself).
    Scores and softmax in float32. Returns ``[n, heads * d]`` in q's dtype. Raises
    ValueError if some query sees no key (its own K must always be among ``k``), or if
    ``kv_heads`` does not divide ``heads``.
    """
    k, v = _share_kv(q.shape[1], k, v, dim=1)
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("nhd,chd->hnc", q.float(), k.float()) * scale
    rel = q_pos[:, None] - k_pos[None, :]  # [n, c]: how far back each key is
    allowed = _context(rel >= 0, rel, window)
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hnc,chd->nhd", probs, v.float())
    return out.reshape(out.shape[0], -1).to(q.dtype)


def attend_one_each(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    valid: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """``attend`` for many sequences with one query each (a decode batch), at once.

    ``q`` ``[b, heads, d]`` at ``q_pos`` ``[b]``; ``k``/``v`` ``[b, c, kv_heads, d]`` at
    ``k_pos`` ``[b, c]``, of which ``valid`` ``[b, c]`` are real (the rest is padding).
    Same masks, grouping and precision as ``attend``. Returns ``[b, heads * d]``.
    """
    k, v = _share_kv(q.shape[1], k, v, dim=2)
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("bhd,bchd->bhc", q.float(), k.float()) * scale
    rel = q_pos[:, None] - k_pos  # [b, c]
    allowed = _context(valid & (rel >= 0), rel, window)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhc,bchd->bhd", probs, v.float())
    return out.reshape(out.shape[0], -1).to(q.dtype)


def _share_kv(
    heads: int, k: torch.Tensor, v: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: ``k`` and ``v`` with their KV heads (axis ``dim``)
    repeated so query head h reads KV head ``h // (heads // kv_heads)``. Raises
    ValueError unless ``kv_heads`` divides ``heads``."""
    kv_heads = k.shape[dim]
    if kv_heads == heads:
        return k, v
    if kv_heads < 1 or heads % kv_heads:
        raise AttentionError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def _context(causal: torch.Tensor, rel: torch.Tensor, window: int | None) -> torch.Tensor:
    """The keys each query sees: ``causal`` (already ``rel >= 0``) and, with a window,
    at most ``window`` back. Raises ValueError if some query sees none."""
    allowed = causal if window is None else causal & (rel <= window)
    if not bool(allowed.any(dim=1).all()):
        raise AttentionError("a query has no key in its context (its own K is missing)")
    return allowed
