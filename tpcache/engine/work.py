"""What one ``ModelEngine.step`` (``forward``) is asked to do, per request, and what it gives back.

Plain records (no torch): a serving loop builds a list of them per step, prefill chunks
and decodes mixed, and gets one ``ForwardOut`` per item, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpcache.cache.keys import TokenLike


@dataclass(frozen=True)
class Prefill:
    """Admit ``rid`` with ``tokens`` (a whole prompt, or its first chunk) and compute the
    tokens after its cached prefix."""

    rid: Any
    tokens: TokenLike
    priority: int = 0
    namespace: Any = None  # its cache namespace (``cache.namespace.CacheNamespace``)


@dataclass(frozen=True)
class Chunk:
    """Chunked prefill of running ``rid``: cache ``done`` (its tokens so far, which have
    KV) for others to match, give ``chunk`` slots and compute it."""

    rid: Any
    done: TokenLike
    chunk: TokenLike


@dataclass(frozen=True)
class Decode:
    """One decode step of running ``rid``: a slot for ``token`` (the last one generated)
    and its output."""

    rid: Any
    token: int


@dataclass(frozen=True)
class Compute:
    """Compute the newest ``len(tokens)`` positions of running ``rid``, whose slots the
    caller already got from the coordinator (``admit``/``extend``). ``logits`` False:
    only the last position's argmax comes back (``ForwardOut.argmax``), enough for
    greedy decoding and cheaper than the logits."""

    rid: Any
    tokens: TokenLike
    logits: bool = True


Work = Prefill | Chunk | Decode | Compute


@dataclass(frozen=True)
class ForwardOut:
    """One request's part of a forward. ``logits``: rank 0's float32 ``[rows, vocab]``
    (every new position's, or the last one's; ``[0, 0]`` when the item asked for none or
    the runner returned only token ids); ``token``: the runner's sampled token id, when
    it samples; ``argmax``: the last position's most likely token id (ties to the lowest
    id), whenever the runner returned logits."""

    logits: np.ndarray
    start: int  # position of the first new token
    computed: int  # tokens every rank ran through the model
    swa_read: int  # SWA-pool positions read per SWA layer (0 without the hybrid cache)
    rid: Any = None
    prefix_len: int = 0  # a Prefill's cached prefix length
    token: int | None = None
    argmax: int | None = None


__all__ = ["Chunk", "Compute", "Decode", "ForwardOut", "Prefill", "Work"]
