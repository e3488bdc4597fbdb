"""A forward's context from a cache's request rows: the coordinator builds it, ranks check it.

The coordinator builds each ``Forward`` (one request) and ``ForwardBatch`` (many) from
its mirror (``build_forward``, ``build_forward_batch``); every rank rebuilds them from its
own cache and refuses a command that differs (``check_forward``, ``check_forward_batch``),
so the slot ids the runner writes and reads are the ones the lockstep cache agreed on.
For the hybrid cache the SWA slots cover only the window the first new token sees
(``start - window`` on), mapped through the cache's full->SWA page pairing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tpcache.cache.errors import CacheError
from tpcache.cache.keys import TokenLike, as_tokens, pages_to_slots
from tpcache.errors import TpcacheError
from tpcache.lockstep.ops import (
    Forward,
    ForwardBatch,
    RequestId,
    pack_slots,
    pack_tokens,
    unpack_slots,
    unpack_tokens,
)
from tpcache.model.batch import RequestInput, RunnerBatch


class ForwardError(TpcacheError, RuntimeError):
    """A forward was refused (on every rank together) or could not run."""


def row_slots(cache, rid) -> np.ndarray:
    """Full-pool slot ids of every token running request ``rid`` holds KV (or room) for.

    Reads the cache's request row; changes nothing. Raises ``UnknownRequest``.
    """
    row = cache.request_row(rid)
    return pages_to_slots(row.pages, cache.page_size, row.num_tokens)


def build_forward(
    cache, rid, tokens: TokenLike, all_logits: bool = True, logits: bool = True
) -> Forward:
    """The ``Forward`` for the newest ``len(tokens)`` positions of ``rid`` (those the last
    admit or extend gave slots to; ``all_logits`` and ``logits`` as ``Forward``'s).
    Changes nothing. Raises ``ForwardError`` for a request that is not running, no tokens
    or tokens that are not ids, or more tokens than the request holds slots for."""
    try:
        toks = as_tokens(tokens)
        row = cache.request_row(rid)
    except CacheError as exc:
        raise ForwardError(f"request {rid!r}: {type(exc).__name__}: {exc}") from None
    return _forward_of(cache, rid, toks, row, all_logits, logits)


def _forward_of(cache, rid, toks: np.ndarray, row, all_logits: bool, logits: bool) -> Forward:
    """``build_forward`` for checked tokens and ``rid``'s row."""
    slots = pages_to_slots(row.pages, cache.page_size, row.num_tokens)
    host = cache.host
    if host is not None and not host.request_ready(rid):  # the host copies it waits for
        raise ForwardError(
            f"request {rid!r} waits for {host.ready_after(rid)} host copies to be done, "
            f"{host.copies_completed()} are (wait_ready first)"
        )
    start = slots.size - toks.size
    if start < 0:
        raise ForwardError(
            f"{toks.size} new tokens for request {rid!r}, but it holds only {slots.size} slots"
        )
    packed = pack_tokens(toks)
    if cache.swa is None:
        return Forward(rid, packed, start, pack_slots(slots), all_logits=all_logits, logits=logits)
    swa_start, swa = cache.swa.request_slots(rid, start)
    return Forward(
        rid, packed, start, pack_slots(slots), swa_start, pack_slots(swa), all_logits, logits
    )


def build_forward_batch(
    cache,
    work: Sequence[tuple[RequestId, TokenLike]],
    all_logits: bool = False,
    logits: Sequence[bool] | None = None,
) -> ForwardBatch:
    """The ``ForwardBatch`` of ``work`` ((request, its newest tokens) pairs, in order);
    ``logits[i]`` False: item i gets only its argmax back (default: every item its
    logits). Changes nothing. Raises ``ForwardError`` for an empty batch, a request
    given twice, or any item ``build_forward`` refuses."""
    if not work:
        raise ForwardError("an empty batch: nothing to compute")
    if logits is not None and len(logits) != len(work):
        raise ForwardError(f"{len(logits)} logits flags for {len(work)} items")
    _check_distinct([rid for rid, _ in work])
    wants = [True] * len(work) if logits is None else [bool(x) for x in logits]
    return ForwardBatch(
        [
            build_forward(cache, rid, toks, all_logits, want)
            for (rid, toks), want in zip(work, wants, strict=True)
        ]
    )


def _check_distinct(rids: list[RequestId]) -> None:
    seen: set[tuple[type, RequestId]] = set()
    for rid in rids:
        key = (type(rid), rid)  # 1 and "1" are different requests
        if key in seen:
            raise ForwardError(f"request {rid!r} is in the batch twice")
        seen.add(key)


def check_forward(cache, cmd: Forward) -> None:
    """Raise ``ForwardError`` unless ``cmd`` is what ``build_forward`` gives on ``cache``
    and its tokens agree with those the cache was told for ``rid``. Changes nothing."""
    try:
        toks = as_tokens(unpack_tokens(cmd.tokens))
        row = cache.request_row(cmd.rid)
    except CacheError as exc:
        raise ForwardError(f"request {cmd.rid!r}: {type(exc).__name__}: {exc}") from None
    want = _forward_of(cache, cmd.rid, toks, row, cmd.all_logits, cmd.logits)
    if want.start != cmd.start:
        raise ForwardError(
            f"request {cmd.rid!r}: forward starts at {cmd.start}, the row says {want.start}"
        )
    for name in ("slots", "swa_slots"):
        if getattr(cmd, name) == getattr(want, name):  # the same packed ids: one compare
            continue
        got, exp = unpack_slots(getattr(cmd, name)), unpack_slots(getattr(want, name))
        if got.size != exp.size or not np.array_equal(got, exp):
            bad = _first_difference(got, exp)
            raise ForwardError(
                f"request {cmd.rid!r}: {name} differ from this rank's cache at index {bad} "
                f"(got {got.size} ids, expected {exp.size})"
            )
    if want.swa_start != cmd.swa_start:
        raise ForwardError(f"request {cmd.rid!r}: swa_start {cmd.swa_start} != {want.swa_start}")
    known = row.tokens
    lo, hi = cmd.start, min(known.size, cmd.start + toks.size)
    if hi > lo and not np.array_equal(known[lo:hi], toks[: hi - lo]):
        raise ForwardError(
            f"request {cmd.rid!r}: new tokens differ from the ones the cache keys them by"
        )


def check_forward_batch(cache, cmd: ForwardBatch) -> None:
    """``check_forward`` of every item, and at most one item per request. Changes
    nothing; raises ``ForwardError`` naming the first item that differs."""
    if not cmd.items:
        raise ForwardError("an empty batch: nothing to compute")
    _check_distinct([item.rid for item in cmd.items])
    for item in cmd.items:
        check_forward(cache, item)


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _ids(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(unpack_slots(data).copy()).to(device)


def to_batch(cmd: ForwardBatch, device: torch.device, after_step: int = -1) -> RunnerBatch:
    """The runner's ``RunnerBatch`` of a (checked) command, as tensors on ``device``."""
    reqs = []
    for item in cmd.items:
        tokens = torch.from_numpy(unpack_tokens(item.tokens).astype(np.int64)).to(device)
        swa = _ids(item.swa_slots, device) if item.swa_slots else None
        reqs.append(
            RequestInput(
                item.rid,
                tokens,
                item.start,
                _ids(item.slots, device),
                item.swa_start,
                swa,
                item.all_logits,
            )
        )
    return RunnerBatch(tuple(reqs), after_step)
