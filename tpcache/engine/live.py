"""``Live``: one request the engine holds, from submission to its last event, and the
rules that read only it (what it holds, what it will still need, when it stops)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tpcache.engine.requests import GenerateRequest, GenEvent


@dataclass(eq=False)
class Live:
    """A request between ``submit`` and its ``Finished`` or ``Failed``. Owned by the
    engine's loop thread (``submit`` makes it; nothing else changes it after).

    ``context`` is what it was (last) admitted with: the prompt and the tokens generated
    before that admission (a resume after preemption or recovery recomputes them). KV
    is held for ``context[:done]``; once ``done == len(context)`` it decodes: each step
    computes ``out[-1]`` and samples the next token.
    """

    req: GenerateRequest
    sink: Callable[[GenEvent], None]
    seq: int  # submission order: admission and preemption follow it
    rng: np.random.Generator
    out: list[int] = field(default_factory=list)  # generated tokens (every one sent)
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    done: int = 0  # context tokens with KV
    running: bool = False  # admitted in the coordinator now
    cached: int = 0  # prefix taken from the cache at its last admission
    prompt_cached: int = 0  # the same, at its first admission (Finished reports it)
    preemptions: int = 0
    recoveries: int = 0
    prefilled: int = 0  # prefill tokens the ranks computed for it, over all admissions
    ended: bool = False  # its Finished or Failed is queued
    # Its prefill runs in steps of its own: it was in two failed steps in a row, and may
    # be what fails them (a prompt the ranks refuse), so it must not take others along.
    solo: bool = False

    @property
    def rid(self) -> str | int:
        return self.req.rid

    @property
    def greedy(self) -> bool:
        """Its next token is the argmax: no draw, no logits needed."""
        return self.req.sampling.temperature == 0.0

    @property
    def prefilling(self) -> bool:
        return self.done < self.context.size

    def resume_tokens(self) -> np.ndarray:
        """What it is admitted with now: prompt + generated so far."""
        return np.asarray([*self.req.prompt, *self.out], dtype=np.int32)

    def final_kv(self) -> int:
        """Tokens with KV once done: the prompt and every output but the last."""
        return len(self.req.prompt) + self.req.sampling.max_new_tokens - 1

    def held_kv(self) -> int:
        """Tokens with slots now (running: its row's length)."""
        if not self.running:
            return 0
        return self.done if self.prefilling else self.context.size + self.new_outs() - 1

    def new_outs(self) -> int:
        """Outputs generated since its admission (the last has no KV yet)."""
        return len(self.out) - (self.context.size - len(self.req.prompt))

    def stop_reason(self, eos: tuple[int, ...]) -> str | None:
        """Why it stops after its newest token, or None to go on."""
        s = self.req.sampling
        tok = self.out[-1]
        if tok in s.stop_token_ids or (not s.ignore_eos and tok in eos):
            return "stop"
        if len(self.out) >= s.max_new_tokens:
            return "length"
        return None


def pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


__all__ = ["Live", "pages"]
