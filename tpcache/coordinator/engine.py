"""``ModelEngine``: run the TP model over a coordinator's cache, request by request.

The cache decides, the ranks compute. For each call the coordinator's mirror gives the
request's row (``admit``/``extend`` first, so the slots exist); the engine turns it into
one ``Forward`` command and sends the same bytes to every rank at once (under Ray, one
actor call each; under torchrun, one broadcast). Every rank checks the command against
its own cache, writes its heads' K and V, attends, and enters the model's all-reduces;
the logits come back from every rank, identical, and rank 0's are returned.

The order of calls to each rank is the coordinator's order (steps, flushed first, then
this forward), so a rank always applies the step that gave the slots before the forward.
Works with any ``RankTransport`` whose ``call`` runs a method on every rank concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpcache.cache.keys import TokenLike, as_tokens
from tpcache.coordinator.core import Coordinator
from tpcache.workers.context import ForwardError, build_forward
from tpcache.workers.lockstep import is_hybrid
from tpcache.workers.ops import decode_forward_result, encode, unpack_slots


@dataclass(frozen=True)
class ForwardOut:
    """One forward: rank 0's logits ``[computed, vocab]`` (float32) of the new tokens."""

    logits: np.ndarray
    start: int  # position of the first new token
    computed: int  # tokens every rank ran through the model
    swa_read: int  # SWA-pool positions read per SWA layer (0 without the hybrid cache)


@dataclass
class EngineCounters:
    """Owned by the engine; read by checks and tests."""

    forwards: int = 0
    computed_tokens: int = 0  # tokens run through the model (as every rank reported)
    hit_tokens: int = 0  # prompt tokens taken from the cache at admission
    tombstoned_hit_pages: int = 0  # hybrid: matched pages that had lost their SWA KV
    max_swa_read_over_new: int = 0  # hybrid: max(SWA positions read - new tokens)
    prefix_lens: list[int] = field(default_factory=list)


class ModelEngine:
    """Prefill (whole or chunked) and decode of requests on a coordinator's TP group.

    Not thread-safe (the coordinator is not). Each method changes the cache through the
    coordinator and the pools through the ranks; it raises the coordinator's typed
    errors before anything is sent, and ``RankCallError`` (cause ``ForwardError``) if the
    ranks refuse a forward.
    """

    def __init__(self, coord: Coordinator, timeout_s: float = 120.0) -> None:
        self.coord = coord
        self.timeout_s = timeout_s
        self.counters = EngineCounters()

    # ---- one request ----------------------------------------------------------------------
    def admit(self, rid: Any, tokens: TokenLike, priority: int = 0) -> tuple[int, ForwardOut]:
        """Admit ``rid`` with ``tokens`` (a whole prompt or its first chunk) and compute the
        tokens after its cached prefix. Returns (prefix length, the forward)."""
        toks = as_tokens(tokens)
        got = self.coord.admit(rid, toks, priority)
        c = self.counters
        c.hit_tokens += got.prefix_len
        c.prefix_lens.append(got.prefix_len)
        mirror = self.coord.mirror
        if is_hybrid(mirror) and got.prefix_len:
            matched = got.slots[: got.prefix_len : mirror.page_size] // mirror.page_size
            c.tombstoned_hit_pages += int((~mirror.alloc.has_swa(matched)).sum())
        return got.prefix_len, self.forward(rid, toks[got.prefix_len :])

    def prefill_more(self, rid: Any, done: TokenLike, chunk: TokenLike) -> ForwardOut:
        """Chunked prefill: cache the ``done`` tokens (which have KV) for others to match,
        then give ``rid`` slots for ``chunk`` and compute it."""
        self.coord.cache_unfinished(rid, done)
        new = as_tokens(chunk)
        self.coord.extend(rid, int(new.size))
        return self.forward(rid, new)

    def decode(self, rid: Any, token: int) -> ForwardOut:
        """One decode step: a slot for ``token`` (the last one generated) and its logits."""
        self.coord.extend(rid, 1)
        return self.forward(rid, [token])

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

    # ---- the model call -------------------------------------------------------------------
    def forward(self, rid: Any, tokens: TokenLike) -> ForwardOut:
        """Compute the newest ``len(tokens)`` positions of ``rid`` on every rank."""
        cmd = build_forward(self.coord.mirror, rid, tokens)
        self.coord.flush()  # the steps that gave the slots must reach the ranks first
        outs = self.coord.ranks.call("forward", encode(cmd), timeout=self.timeout_s)
        results = [decode_forward_result(o) for o in outs]
        first = results[0]
        logits = np.frombuffer(first.logits, dtype="<f4").reshape(first.computed, first.vocab)
        scale = float(np.abs(logits).max()) if logits.size else 0.0
        for r in results[1:]:
            other = np.frombuffer(r.logits, dtype="<f4")
            if (
                r.computed != first.computed
                or other.size != logits.size
                or float(np.abs(other - logits.ravel()).max(initial=0.0)) > 1e-3 * scale
            ):
                raise ForwardError(
                    f"request {rid!r}: rank {r.rank}'s logits differ from rank 0's "
                    "(after the all-reduces every rank holds the same hidden state)"
                )
        n = first.computed
        swa_read = unpack_slots(cmd.swa_slots).size
        c = self.counters
        c.forwards += 1
        c.computed_tokens += n
        if swa_read:
            c.max_swa_read_over_new = max(c.max_swa_read_over_new, swa_read - n)
        return ForwardOut(logits.copy(), cmd.start, n, swa_read)
