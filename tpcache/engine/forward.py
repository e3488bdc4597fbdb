"""``ModelEngine``: run a TP group's model runner over a coordinator's cache, one batched
forward per step.

The cache decides, the ranks compute. For a step (``step``: a list of ``Prefill``,
``Chunk``, ``Decode`` and ``Compute`` items, at most one per request) the engine first
makes every item's cache calls through the coordinator (admit, cache_unfinished, extend),
in order, so the slots exist; then it turns the mirror's rows into ONE ``ForwardBatch``
and sends the same bytes to every rank at once (under Ray, over the step channel; under
torchrun, one broadcast). Every rank checks every item against its own cache, and its
runner writes the new tokens' K and V, attends, and enters its collectives; every rank
returns its outputs, which must agree, and rank 0's are returned.

The order of calls to each rank is the coordinator's order (steps, flushed first, then
this forward), so a rank always applies the step that gave the slots before the forward.
Works with any ``RankTransport`` whose ``call`` runs a method on every rank concurrently.
The single-request methods (``admit``, ``prefill_more``, ``decode``, ``forward``) are
batches of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpcache.cache.errors import DuplicateRequest, UnknownRequest
from tpcache.cache.keys import TokenLike, as_tokens
from tpcache.cache.reqtable import check_request_id
from tpcache.coordinator.core import Coordinator
from tpcache.coordinator.step_types import RankCallError
from tpcache.engine.work import (
    Chunk,
    Compute,
    Decode,
    ForwardOut,
    Prefill,
    Work,
)
from tpcache.lockstep.ops import (
    ForwardBatchResult,
    RequestId,
    decode_forward_batch_result,
    encode,
    unpack_slots,
)
from tpcache.model.context import ForwardError, build_forward, build_forward_batch

__all__ = ["Chunk", "Compute", "Decode", "ForwardOut", "ModelEngine", "Prefill", "Work"]


@dataclass
class EngineCounters:
    """Owned by the engine; read by checks and tests."""

    forwards: int = 0  # batched forwards (one per step)
    items: int = 0  # request parts of those forwards
    max_batch: int = 0  # most requests in one forward
    computed_tokens: int = 0  # tokens run through the model (as every rank reported)
    hit_tokens: int = 0  # prompt tokens taken from the cache at admission
    tombstoned_hit_pages: int = 0  # hybrid: matched pages that had lost their SWA KV
    max_swa_read_over_new: int = 0  # hybrid: max(SWA positions read - new tokens)
    prefix_lens: list[int] = field(default_factory=list)


class ModelEngine:
    """Prefill (whole or chunked) and decode of requests on a coordinator's TP group.

    Not thread-safe (one caller drives the loop). Each method changes the cache through the
    coordinator and the pools through the ranks; it raises the coordinator's typed
    errors before anything is sent, and ``RankCallError`` (cause ``ForwardError``) if the
    ranks refuse a forward.
    """

    def __init__(self, coord: Coordinator, timeout_s: float = 120.0) -> None:
        self.coord = coord
        self.timeout_s = timeout_s
        self.counters = EngineCounters()

    # ---- one step over many requests ------------------------------------------------------
    def step(self, work: Sequence[Work], *, all_logits: bool = False) -> list[ForwardOut]:
        """Make every item's cache calls, in order, then compute all of them in one
        forward. Returns one ``ForwardOut`` per item, in order (``all_logits``: every new
        position's logits, else the last one's).

        Raises, before anything changes: ForwardError for an empty step, an item that is
        not work or a request given twice, or a ``Compute`` the row has no slots for;
        the cache's typed errors for a bad id or tokens, a ``Prefill`` of a running
        request (DuplicateRequest) or another item of one that is not (UnknownRequest).
        A cache call that fails later (OutOfCapacity) raises with the items before it
        applied; so does a forward the ranks refuse (``RankCallError``, cause
        ForwardError: e.g. token ids outside the runner's vocabulary): those requests
        hold slots without KV, and the caller aborts or retries them.
        """
        checked = self._check(work)
        prefix: dict[RequestId, int] = {}
        pairs: list[tuple[RequestId, np.ndarray]] = []
        wants = [w.logits if isinstance(w, Compute) else True for w, _, _ in checked]
        for w, rid, toks in checked:
            match w:
                case Prefill():
                    prefix[rid] = self._admit(rid, toks, w.priority, w.namespace)
                    toks = toks[prefix[rid] :]
                case Chunk():
                    self.coord.cache_unfinished(rid, w.done)
                    self.coord.extend(rid, int(toks.size))
                case Decode():
                    self.coord.extend(rid, 1)
            pairs.append((rid, toks))
        return self._forward(pairs, all_logits, prefix, wants)

    def _check(self, work: Sequence[Work]) -> list[tuple[Work, RequestId, np.ndarray]]:
        """Each item with its normalised id and the tokens it computes (a Prefill: all it
        admits). Changes nothing."""
        if not work:
            raise ForwardError("an empty step: nothing to compute")
        mirror = self.coord.mirror
        running = set(mirror.running_ids())
        seen: set[tuple[type, RequestId]] = set()
        # A step of Compute items alone makes no cache call: the forward's own build,
        # before anything changes, checks their slots, so they are not built twice.
        compute_only = all(isinstance(w, Compute) for w in work)
        out = []
        for w in work:
            if not isinstance(w, Prefill | Chunk | Decode | Compute):
                raise ForwardError(f"not a work item: {type(w).__name__}")
            rid = check_request_id(w.rid)
            if (type(rid), rid) in seen:
                raise ForwardError(f"request {rid!r} is in the step twice")
            seen.add((type(rid), rid))
            if isinstance(w, Prefill) and rid in running:
                raise DuplicateRequest(f"request {rid!r} is running already")
            if not isinstance(w, Prefill) and rid not in running:
                raise UnknownRequest(f"request {rid!r} is not running")
            match w:
                case Prefill(tokens=toks) | Compute(tokens=toks) | Chunk(chunk=toks):
                    toks = as_tokens(toks)
                case Decode(token=token):
                    toks = as_tokens([token])
            if isinstance(w, Chunk):
                as_tokens(w.done)
            if isinstance(w, Compute) and not compute_only:
                build_forward(mirror, rid, toks)  # its slots exist already
            out.append((w, rid, toks))
        return out

    def _admit(self, rid: RequestId, toks: np.ndarray, priority: int, space: Any = None) -> int:
        got = self.coord.admit(rid, toks, priority, namespace=space)
        c = self.counters
        c.hit_tokens += got.prefix_len
        c.prefix_lens.append(got.prefix_len)
        mirror = self.coord.mirror
        if got.prefix_len and mirror.swa is not None:
            matched = got.slots[: got.prefix_len : mirror.page_size] // mirror.page_size
            c.tombstoned_hit_pages += mirror.swa.tombstoned_pages(matched)
        return got.prefix_len

    # ---- one request (a batch of one) --------------------------------------------------------
    def admit(self, rid: Any, tokens: TokenLike, priority: int = 0) -> tuple[int, ForwardOut]:
        """Admit ``rid`` with ``tokens`` (a whole prompt or its first chunk) and compute the
        tokens after its cached prefix. Returns (prefix length, the forward)."""
        out = self.step([Prefill(rid, tokens, priority)], all_logits=True)[0]
        return out.prefix_len, out

    def prefill_more(self, rid: Any, done: TokenLike, chunk: TokenLike) -> ForwardOut:
        """Chunked prefill: cache the ``done`` tokens (which have KV) for others to match,
        then give ``rid`` slots for ``chunk`` and compute it."""
        return self.step([Chunk(rid, done, chunk)], all_logits=True)[0]

    def decode(self, rid: Any, token: int) -> ForwardOut:
        """One decode step: a slot for ``token`` (the last one generated) and its logits."""
        return self.step([Decode(rid, token)], all_logits=True)[0]

    def prefill(
        self, rid: Any, prompt: TokenLike, chunk: int | None = None
    ) -> tuple[int, np.ndarray]:
        """Admit and compute a whole prompt, in chunks of ``chunk`` tokens if given.
        Returns (prefix length, logits of every computed position)."""
        toks = as_tokens(prompt)
        step = toks.size if chunk is None else chunk
        prefix, out = self.admit(rid, toks[:step])
        parts = [out.logits]
        done = min(step, toks.size)
        while done < toks.size:
            nxt = min(done + step, toks.size)
            parts.append(self.prefill_more(rid, toks[:done], toks[done:nxt]).logits)
            done = nxt
        return prefix, np.concatenate(parts)

    def finish(self, rid: Any, output_tokens: TokenLike = ()) -> int:
        """Finish ``rid`` (cache its prompt and the outputs that have KV)."""
        return self.coord.finish(rid, output_tokens)

    def forward(self, rid: Any, tokens: TokenLike) -> ForwardOut:
        """Compute the newest ``len(tokens)`` positions of ``rid`` on every rank (every
        new position's logits)."""
        return self.step([Compute(rid, tokens)], all_logits=True)[0]

    # ---- the model call -------------------------------------------------------------------
    def _run(self, data: bytes) -> list[bytes]:
        """Every rank's encoded result of the encoded batch ``data``. Where the ranks check
        each other (``peer_check``) they agree on it by a collective (``forward_batch``);
        on the step channel the coordinator sees every rank's verdict itself and sends
        the go-ahead, which costs a rank less than a collective."""
        ranks, timeout = self.coord.ranks, self.timeout_s
        if ranks.peer_check:
            return ranks.call("forward_batch", data, timeout=timeout)
        refused = _refusal(ranks.call("prepare_forward", data, timeout=timeout))
        if refused is not None:
            raise refused
        return ranks.call("run_forward", timeout=timeout)

    def _forward(
        self,
        pairs: list[tuple[RequestId, np.ndarray]],
        all_logits: bool,
        prefix: dict[RequestId, int],
        wants: list[bool],
    ) -> list[ForwardOut]:
        if self.coord.mirror.host is not None:  # a host tier's copies
            self.coord.wait_ready([rid for rid, _ in pairs], self.timeout_s)
        cmd = build_forward_batch(self.coord.mirror, pairs, all_logits, wants)
        with self.coord.lock:  # no step may reach the ranks between the two halves
            self.coord.flush()  # the steps that gave the slots must reach the ranks first
            outs = self._run(encode(cmd))
        results = [decode_forward_batch_result(o) for o in outs]
        first = results[0]
        logits = np.frombuffer(first.logits, dtype="<f4").reshape(sum(first.rows), first.vocab)
        _check_ranks_agree(results)
        ids = np.frombuffer(first.token_ids, dtype="<i8") if first.token_ids else None
        tops = np.frombuffer(first.top, dtype="<i8") if first.top else None
        c = self.counters
        c.forwards += 1
        c.items += len(pairs)
        c.max_batch = max(c.max_batch, len(pairs))
        c.computed_tokens += sum(first.computed)
        got, row = [], 0
        for i, (item, (rid, _)) in enumerate(zip(cmd.items, pairs, strict=True)):
            n, rows = first.computed[i], first.rows[i]
            swa_read = unpack_slots(item.swa_slots).size
            if swa_read:
                c.max_swa_read_over_new = max(c.max_swa_read_over_new, swa_read - n)
            part = logits[row : row + rows].copy() if rows else np.zeros((0, 0), np.float32)
            row += rows
            token = int(ids[i]) if ids is not None else None
            top = int(tops[i]) if tops is not None else None
            got.append(
                ForwardOut(part, item.start, n, swa_read, rid, prefix.get(rid, 0), token, top)
            )
        return got


def _refusal(verdicts: list[str | None]) -> RankCallError | None:
    """The error of a forward some rank refused (``prepare_forward``'s answers)."""
    for rank, why in enumerate(verdicts):
        if why is not None:
            return RankCallError(rank, ForwardError(f"forward refused on rank {rank}: {why}"))
    return None


def _check_ranks_agree(results: list[ForwardBatchResult]) -> None:
    """Raise ForwardError unless every rank computed the same tokens, sampled the same
    ids and has the same argmax for every item as rank 0, with the logit there within
    1e-3 of the largest such logit's magnitude (after the all-reduces every rank holds
    the same hidden state; its last bits may differ where a rank's kernels round
    differently). Only rank 0 sends logits (``ForwardBatchResult``)."""
    first = results[0]
    ref = np.frombuffer(first.top_logit, dtype="<f8")
    scale = float(np.abs(ref).max(initial=0.0))
    for r in results[1:]:
        other = np.frombuffer(r.top_logit, dtype="<f8")
        same = (r.computed, r.token_ids, r.top, r.vocab) == (
            first.computed,
            first.token_ids,
            first.top,
            first.vocab,
        )
        if not same or other.shape != ref.shape or np.any(np.abs(other - ref) > 1e-3 * scale):
            raise ForwardError(
                f"rank {r.rank}'s outputs differ from rank 0's (after the all-reduces "
                "every rank holds the same hidden state)"
            )
