"""Choosing the next token from the last position's logits, on the coordinator's side:
greedy, or temperature, top-k and top-p with the request's own generator, so each token
is decided once, whatever happens to the ranks afterwards."""

from __future__ import annotations

import numpy as np

from tpcache.engine.requests import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from ``logits`` (``[vocab]``). Greedy (temperature 0): the argmax,
    ties to the lowest id, no draw. Otherwise: logits / temperature, cut to the
    ``top_k`` most likely (ties to the lowest id), then to the smallest most-likely set
    whose probability reaches ``top_p``, and one uniform draw from ``rng``. Pure apart
    from that draw."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    order = np.argsort(-x, kind="stable")  # most likely first; equal ones by id
    if params.top_k:
        order = order[: params.top_k]
    z = x[order]
    p = np.exp(z - z[0])
    cum = np.cumsum(p)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(cum, params.top_p * cum[-1])) + 1
        order, cum = order[:keep], cum[:keep]
    u = rng.random() * cum[-1]
    i = min(int(np.searchsorted(cum, u, side="right")), order.size - 1)
    return int(order[i])


__all__ = ["sample"]
