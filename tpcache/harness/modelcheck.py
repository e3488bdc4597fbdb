"""Does cached KV give the right answer? Random requests through the cache vs full recompute.

One workload, used by the Ray tests and by ``python -m tpcache.torchrun check``: random
prompts built from a few shared prefixes (and continuations of earlier requests' whole
sequences, so decoded tokens' KV is reused too), run in waves of concurrent requests:
prefill (whole, or chunked with ``cache_unfinished`` so a later request can hit an
unfinished one), a few greedy decode steps, finish. Every logit row the ranks return is
compared with ``reference_logits`` of the same sequence (no cache, whole weights), and
every greedy token with the reference's argmax. The report says how much came from the
cache and how much was computed, so a test can assert that the cache was really used.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from tpcache.engine.forward import ModelEngine
from tpcache.engine.work import Chunk, Decode, Prefill, Work
from tpcache.errors import TpcacheError


class Reference(Protocol):
    """The model a check compares against: its vocabulary and its full recompute
    (``ModelSpec``, ``LlamaSpec``)."""

    @property
    def vocab(self) -> int: ...

    def full_logits(self, tokens: list[int], dtype: str) -> np.ndarray:
        """Logits ``[len(tokens), vocab]`` of every position, no cache."""
        ...


class WorkloadError(TpcacheError, ValueError):
    """A model-check workload that cannot run; the message names the field."""


@dataclass(frozen=True)
class Workload:
    """A random workload; the same seed gives the same requests."""

    seed: int
    requests: int = 8
    prefixes: int = 3
    prefix_len: tuple[int, int] = (8, 32)
    suffix_len: tuple[int, int] = (1, 10)
    decode_steps: int = 3
    chunk: int | None = None  # chunked prefill in chunks of this many tokens
    concurrency: int = 2  # requests running at once (one wave)
    continue_prob: float = 0.25  # a prompt that continues an earlier finished sequence
    max_len: int = 64  # longest request (prompt + decode): continuations stop there

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.decode_steps < 0:
            raise WorkloadError(f"bad workload {self}")
        if self.prefix_len[1] + self.suffix_len[1] + self.decode_steps > self.max_len:
            raise WorkloadError(f"max_len={self.max_len} is below the longest fresh request")
        if self.chunk is not None and self.chunk < 1:
            raise WorkloadError(f"chunk must be >= 1, got {self.chunk}")


@dataclass
class Report:
    """What a workload did and how far the cached logits were from full recompute."""

    seed: int
    requests: int = 0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    forwards: int = 0  # batched forwards
    items: int = 0  # request parts of them
    max_batch: int = 0  # most requests in one forward (over the engine's life)
    max_rel_err: float = 0.0
    worst: str = ""
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    greedy_ambiguous: int = 0  # reference top-2 closer than the tolerance: not judged
    evicted_pages: int = 0
    evicted_swa_pages: int = 0
    tombstoned_hit_pages: int = 0
    max_swa_read_over_new: int = 0
    prefix_lens: list[int] = field(default_factory=list)

    def ok(self, tol: float) -> bool:
        """Every logit within ``tol`` (relative), every judged greedy token equal, and no
        token computed twice: computed == prompt + decode tokens - cache hits."""
        return (
            self.max_rel_err <= tol
            and self.greedy_mismatches == 0
            and self.computed_tokens == self.prompt_tokens + self.decode_tokens - self.hit_tokens
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _draw(rng: random.Random, vocab: int, lo_hi: tuple[int, int]) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(*lo_hi))]


def _wave(
    wl: Workload,
    rng: random.Random,
    vocab: int,
    prefixes: list[list[int]],
    finished: list[list[int]],
) -> list[list[int]]:
    """One wave's prompts: a shared prefix, or an earlier request's whole sequence, and a
    random suffix each."""
    room = wl.max_len - wl.suffix_len[1] - wl.decode_steps
    fits = [seq for seq in finished if len(seq) <= room]
    out = []
    for _ in range(wl.concurrency):
        if fits and rng.random() < wl.continue_prob:
            base = rng.choice(fits)
        else:
            base = rng.choice(prefixes)
        out.append(base + _draw(rng, vocab, wl.suffix_len))
    return out


Wave = list[list[int]]
# A scripted prompt: tokens, or (j, suffix): request j's whole finished sequence + suffix.
Prompt = list[int] | tuple[int, list[int]]


def run_workload(
    engine: ModelEngine,
    spec: Reference,
    wl: Workload,
    *,
    tol: float,
    dtype: str = "float32",
    rid_prefix: str = "w",
) -> Report:
    """Run the random workload ``wl`` through ``engine`` and compare everything with full
    recompute. Changes the cache (requests are admitted and finished; none stays running).
    ``tol`` only decides which greedy tokens are too close to call."""
    rng = random.Random(wl.seed)
    prefixes = [_draw(rng, spec.vocab, wl.prefix_len) for _ in range(wl.prefixes)]
    made = [0]

    def next_wave(finished: list[list[int]]) -> Wave | None:
        if made[0] >= wl.requests:
            return None
        wave = _wave(wl, rng, spec.vocab, prefixes, finished)[: wl.requests - made[0]]
        made[0] += len(wave)
        return wave

    return run_requests(
        engine, spec, next_wave, wl.chunk, wl.decode_steps, tol, dtype, wl.seed, rid_prefix
    )


def run_script(
    engine: ModelEngine,
    spec: Reference,
    waves: list[list[Prompt]],
    *,
    tol: float,
    chunk: int | None = None,
    decode_steps: int = 3,
    dtype: str = "float32",
    rid_prefix: str = "s",
) -> Report:
    """Run fixed ``waves`` of prompts (see ``Prompt``) as ``run_workload`` runs its own."""
    it = iter(waves)

    def next_wave(finished: list[list[int]]) -> Wave | None:
        wave = next(it, None)
        if wave is None:
            return None
        return [list(p) if not isinstance(p, tuple) else finished[p[0]] + p[1] for p in wave]

    return run_requests(engine, spec, next_wave, chunk, decode_steps, tol, dtype, 0, rid_prefix)


def run_requests(
    engine: ModelEngine,
    spec: Reference,
    next_wave: Callable[[list[list[int]]], Wave | None],
    chunk: int | None,
    decode_steps: int,
    tol: float,
    dtype: str,
    seed: int,
    rid_prefix: str,
) -> Report:
    """Run waves of concurrent requests until ``next_wave`` (given the finished requests'
    whole sequences, in order) returns None, one batched forward per round (``_round``):
    prefill (request i joins in round i), ``decode_steps`` greedy steps, then finish in
    order; then compare every computed row and greedy token with full recompute."""
    rep = Report(seed=seed)
    c0 = _snapshot(engine)
    marks0 = engine.coord.mirror.eviction_marks()
    finished: list[list[int]] = []
    while (prompts := next_wave(finished)) is not None:
        reqs = [_Req(f"{rid_prefix}{seed}-{len(finished) + i}", p) for i, p in enumerate(prompts)]
        step = chunk or max(len(p) for p in prompts)
        rnd = 0
        while _round(engine, reqs, rnd, step, decode_steps):
            rnd += 1
        for r in reqs:
            last = int(np.argmax(r.parts[-1][-1]))
            engine.finish(r.rid, [*r.generated, last])
            seq = r.prompt + r.generated
            finished.append(seq)
            _compare(rep, spec, r.rid, seq, len(r.prompt), r.prefix, r.parts, tol, dtype)
            rep.requests += 1
            rep.prompt_tokens += len(r.prompt)
            rep.decode_tokens += len(r.generated)
            rep.prefix_lens.append(r.prefix)
    c1 = _snapshot(engine)
    marks1 = engine.coord.mirror.eviction_marks()
    for name in _COUNTED:
        setattr(rep, name, c1[name] - c0[name])
    rep.max_swa_read_over_new = engine.counters.max_swa_read_over_new
    rep.max_batch = engine.counters.max_batch
    rep.evicted_pages = marks1[0] - marks0[0]
    rep.evicted_swa_pages = marks1[1] - marks0[1] if len(marks1) > 1 else 0
    return rep


@dataclass
class _Req:
    """One request of a wave, as the check drives it (owned by ``run_requests``)."""

    rid: str
    prompt: list[int]
    prefix: int = -1  # -1: not admitted yet
    done: int = 0  # prompt tokens with KV (or computed in the round under way)
    parts: list[np.ndarray] = field(default_factory=list)  # logit rows per forward
    generated: list[int] = field(default_factory=list)


def _round(engine: ModelEngine, reqs: list[_Req], rnd: int, step: int, decode_steps: int) -> bool:
    """One batched forward over the wave: request i is admitted in round i (after the
    others' chunks so far were cached unfinished, so it may hit them); the others take
    their next prefill chunk or greedy decode step. False when nothing was left to do."""
    work: list[Work] = []
    for i, r in enumerate(reqs):
        if r.prefix < 0:
            if i <= rnd:
                work.append(Prefill(r.rid, r.prompt[:step]))
        elif r.done < len(r.prompt):
            nxt = min(r.done + step, len(r.prompt))
            work.append(Chunk(r.rid, r.prompt[: r.done], r.prompt[r.done : nxt]))
        elif len(r.generated) < decode_steps:
            token = int(np.argmax(r.parts[-1][-1]))
            r.generated.append(token)
            work.append(Decode(r.rid, token))
    if not work:
        return False
    by_rid = {r.rid: r for r in reqs}
    for out in engine.step(work, all_logits=True):
        r = by_rid[out.rid]
        if r.prefix < 0:
            r.prefix = out.prefix_len
        if r.done < len(r.prompt):
            r.done = out.start + out.computed
        r.parts.append(out.logits)
    return True


# The engine's counters a run reports as its own growth (``Report`` fields of these names).
_COUNTED = ("hit_tokens", "computed_tokens", "forwards", "items", "tombstoned_hit_pages")


def _snapshot(engine: ModelEngine) -> dict[str, int]:
    return {name: getattr(engine.counters, name) for name in _COUNTED}


def _compare(
    rep: Report,
    spec: Reference,
    rid: str,
    seq: list[int],
    prompt_len: int,
    prefix: int,
    parts: list[np.ndarray],
    tol: float,
    dtype: str,
) -> None:
    """Compare the rows computed for ``rid`` (positions ``prefix ..`` of ``seq``) with the
    reference over ``seq``; judge each greedy token against the reference argmax."""
    ref = spec.full_logits(seq, dtype)  # on the CPU, in the ranks' dtype
    got = np.concatenate(parts)
    want = ref[prefix : len(seq)]
    if got.shape != want.shape:
        rep.max_rel_err = float("inf")
        rep.worst = f"{rid}: got {got.shape} logit rows, expected {want.shape}"
        return
    err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)
    if err > rep.max_rel_err:
        rep.max_rel_err = err
        rep.worst = f"{rid} (prefix {prefix} of {prompt_len}, dtype {dtype})"
    scale = float(np.abs(want).max())
    # Position p's logits chose token p + 1 for p = prompt_len - 1 .. len(seq) - 2.
    for p in range(prompt_len - 1, len(seq) - 1):
        row = ref[p]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= 2 * tol * scale:
            rep.greedy_ambiguous += 1
            continue
        rep.greedy_checked += 1
        if int(np.argmax(row)) != seq[p + 1]:
            rep.greedy_mismatches += 1
