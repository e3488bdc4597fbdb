"""A forward's context from a cache's request row: the coordinator builds it, ranks check it.

The coordinator builds each ``Forward`` from its mirror (``build_forward``); every rank
rebuilds it from its own cache and refuses a command that differs (``check_forward``),
so the slot ids the model writes and reads are the ones the lockstep cache agreed on.
For the hybrid cache the SWA slots cover only the window the first new token sees
(``start - window`` on), mapped through the cache's full->SWA page pairing.
"""

from __future__ import annotations

import numpy as np
import torch

from tpcache.cache.keys import as_tokens, pages_to_slots
from tpcache.workers.lockstep import is_hybrid
from tpcache.workers.model import Context
from tpcache.workers.ops import Forward, pack_slots, pack_tokens, unpack_slots, unpack_tokens


class ForwardError(RuntimeError):
    """A forward was refused (on every rank together) or could not run."""


def row_slots(cache, rid) -> np.ndarray:
    """Full-pool slot ids of every token running request ``rid`` holds KV (or room) for.

    Reads the cache's request row; changes nothing. Raises ``UnknownRequest``.
    """
    req = cache.reqs.get(rid)
    return pages_to_slots(req.pages, cache.page_size, req.num_tokens)


def build_forward(cache, rid, tokens) -> Forward:
    """The ``Forward`` for the newest ``len(tokens)`` positions of ``rid`` (those the last
    admit or extend gave slots to). Raises ``ForwardError`` for more tokens than that."""
    toks = as_tokens(tokens)
    slots = row_slots(cache, rid)
    start = slots.size - toks.size
    if start < 0:
        raise ForwardError(
            f"{toks.size} new tokens for request {rid!r}, but it holds only {slots.size} slots"
        )
    if not is_hybrid(cache):
        return Forward(rid, pack_tokens(toks), start, pack_slots(slots))
    swa_start = max(0, start - cache.window)
    swa = cache.swa_slots(slots[swa_start:])
    return Forward(rid, pack_tokens(toks), start, pack_slots(slots), swa_start, pack_slots(swa))


def check_forward(cache, cmd: Forward) -> None:
    """Raise ``ForwardError`` unless ``cmd`` is what ``build_forward`` gives on ``cache``
    and its tokens agree with those the cache was told for ``rid``. Changes nothing."""
    toks = unpack_tokens(cmd.tokens)
    try:
        want = build_forward(cache, cmd.rid, toks)
    except Exception as exc:
        raise ForwardError(f"request {cmd.rid!r}: {type(exc).__name__}: {exc}") from None
    if want.start != cmd.start:
        raise ForwardError(
            f"request {cmd.rid!r}: forward starts at {cmd.start}, the row says {want.start}"
        )
    for name in ("slots", "swa_slots"):
        got, exp = unpack_slots(getattr(cmd, name)), unpack_slots(getattr(want, name))
        if got.size != exp.size or not np.array_equal(got, exp):
            bad = _first_difference(got, exp)
            raise ForwardError(
                f"request {cmd.rid!r}: {name} differ from this rank's cache at index {bad} "
                f"(got {got.size} ids, expected {exp.size})"
            )
    if want.swa_start != cmd.swa_start:
        raise ForwardError(f"request {cmd.rid!r}: swa_start {cmd.swa_start} != {want.swa_start}")
    known = cache.reqs.get(cmd.rid).tokens
    lo, hi = cmd.start, min(known.size, cmd.start + toks.size)
    if hi > lo and not np.array_equal(known[lo:hi], toks[: hi - lo]):
        raise ForwardError(
            f"request {cmd.rid!r}: new tokens differ from the ones the cache keys them by"
        )


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def to_context(cmd: Forward) -> tuple[torch.Tensor, Context]:
    """The new tokens and the model's ``Context`` of a (checked) command, as tensors."""
    tokens = torch.from_numpy(unpack_tokens(cmd.tokens).astype(np.int64))
    slots = torch.from_numpy(unpack_slots(cmd.slots).copy())
    swa = torch.from_numpy(unpack_slots(cmd.swa_slots).copy()) if cmd.swa_slots else None
    return tokens, Context(cmd.start, slots, cmd.swa_start, swa)
