"""One forward's batch, as a runner gets it, and the paged attention both shipped runners
use over it.

A batch is a tuple of requests in the coordinator's order; each carries its new tokens
and where their K and V go and come from, as slot ids the rank has checked against its
own cache. Nothing here decides a slot: these records only carry the cache's choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpcache.cache.records import RequestId
from tpcache.model.attention import attend, attend_one_each


@dataclass(frozen=True)
class RequestInput:
    """One request of a batch (tensors on the rank's device, ids int64).

    ``tokens``: the ``n`` new tokens, at positions ``start .. start + n - 1``.
    ``read_slots``: the full-pool slot of every position of the context, cached prefix
    and new tokens (``start + n``); the new tokens' K and V go to its last ``n``.
    ``swa_slots`` (hybrid cache only): the SWA-pool slots of positions ``swa_start ..``
    to the end: the window the first new token sees, then the new tokens.
    ``all_logits``: return every new position's logits, not only the last one's.
    """

    rid: RequestId
    tokens: torch.Tensor
    start: int
    read_slots: torch.Tensor
    swa_start: int = 0
    swa_slots: torch.Tensor | None = None
    all_logits: bool = False

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=self.tokens.device)

    @property
    def write_slots(self) -> torch.Tensor:
        """Full-pool slots of the new tokens."""
        return self.read_slots[self.start : self.end]

    @property
    def rows(self) -> int:
        """Logit rows this request gets back."""
        return self.n if self.all_logits else 1

    def context(self, pool: str, window: int | None) -> tuple[torch.Tensor, int, torch.Tensor]:
        """For a layer whose KV is in ``pool`` ("full" or "swa") and that sees ``window``
        tokens back (None: all): (slots to read, position of the first of them, slots
        to write the new tokens at)."""
        if pool == "swa":
            assert self.swa_slots is not None, "an SWA layer without SWA slots"
            return self.swa_slots, self.swa_start, self.swa_slots[-self.n :]
        lo = 0 if window is None else max(0, self.start - window)
        return self.read_slots[lo : self.end], lo, self.write_slots


@dataclass(frozen=True)
class RunnerBatch:
    """One forward over many requests (prefill chunks and decodes mixed).

    ``after_step``: the last cache step this rank applied before the forward (every
    slot here was given by that step or an earlier one). The flat views (``tokens``,
    ``positions``, ``write_slots``, ``query_starts``) concatenate the requests in order,
    as varlen attention kernels take them.
    """

    requests: tuple[RequestInput, ...]
    after_step: int = -1

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        return torch.cat([r.tokens for r in self.requests])

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return torch.cat([r.positions for r in self.requests])

    @functools.cached_property
    def write_slots(self) -> torch.Tensor:
        return torch.cat([r.write_slots for r in self.requests])

    @functools.cached_property
    def query_starts(self) -> list[int]:
        """Offset of each request's first new token in the flat views, then the total."""
        out = [0]
        for r in self.requests:
            out.append(out[-1] + r.n)
        return out

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    def output_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden`` (one per new token, flat order) that become outputs:
        every new token's for requests with ``all_logits``, else the last one's."""
        starts = self.query_starts
        picks = [
            torch.arange(s, e) if r.all_logits else torch.tensor([e - 1])
            for r, s, e in zip(self.requests, starts, starts[1:], strict=False)
        ]
        return hidden[torch.cat(picks).to(hidden.device)]


def paged_attention(
    batch: RunnerBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: str,
    window: int | None,
    bufs: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """One layer's attention for the whole batch over the KV pool.

    ``q`` ``[T, q_heads, d]``, ``k``/``v`` ``[T, kv_heads, d]``: the batch's new tokens in
    flat order, rotary positions applied. Their K and V are written into ``bufs`` (the
    layer's K and V buffers in ``pool``) at each request's write slots, one copy for the
    whole batch; then each request's queries attend over its context *read back from the
    pool*: the one-token requests (decodes) together, one gather for all of them, the
    others one gather each. No request reads what another writes in the same batch: a
    request's new slots are its own until it is cached. Returns ``[T, q_heads * d]`` in
    q's dtype.
    """
    kbuf, vbuf = bufs
    ctx = [r.context(pool, window) for r in batch.requests]
    writes = torch.cat([c[2] for c in ctx])
    kbuf.index_copy_(0, writes, k)
    vbuf.index_copy_(0, writes, v)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    starts = batch.query_starts
    singles = [i for i, r in enumerate(batch.requests) if r.n == 1]
    if len(singles) > 1:
        rows = torch.tensor([starts[i] for i in singles], device=q.device)
        out[rows] = _attend_singles(q[rows], [ctx[i] for i in singles], kbuf, vbuf, window)
    for i, (r, (read, lo, _)) in enumerate(zip(batch.requests, ctx, strict=True)):
        if r.n == 1 and len(singles) > 1:
            continue
        k_pos = torch.arange(lo, lo + int(read.numel()), device=q.device)
        kc, vc = kbuf.index_select(0, read), vbuf.index_select(0, read)
        out[starts[i] : starts[i + 1]] = attend(
            q[starts[i] : starts[i + 1]], kc, vc, r.positions, k_pos, window
        )
    return out


def _attend_singles(
    q: torch.Tensor,
    ctx: list[tuple[torch.Tensor, int, torch.Tensor]],
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attention of ``len(ctx)`` one-token requests: their contexts gathered into one
    padded block (padding reads slot 0 and is masked out). The query of each is its
    context's last position."""
    lens = torch.tensor([int(c[0].numel()) for c in ctx], device=q.device)
    idx = torch.nn.utils.rnn.pad_sequence([c[0] for c in ctx], batch_first=True)
    cols = torch.arange(idx.shape[1], device=q.device)
    k_pos = torch.tensor([c[1] for c in ctx], device=q.device)[:, None] + cols[None, :]
    q_pos = k_pos[:, 0] + lens - 1
    valid = cols[None, :] < lens[:, None]
    kc, vc = kbuf[idx], vbuf[idx]  # [b, c, kv_heads, d]: one gather for every request
    return attend_one_each(q, kc, vc, q_pos, k_pos, valid, window)


__all__ = ["RequestInput", "RunnerBatch", "paged_attention"]
