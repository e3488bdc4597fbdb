"""The serving loop of ``tpcache generate``: continuous batching over a ``ModelEngine``,
fed by clients over ZMQ (``gen_wire``). It lives in the demo frontend, not in the
coordinator: the coordinator only keeps the cache; this loop decides who runs.

Each step has a token budget (``step_tokens``). It is filled in this order: one decode
for every request that is generating; the next chunk of every request still in prefill,
in admission order; then new requests, in trace order (``Submit.seq``), each admitted
with its whole cached prefix (``admit_prefix_len``, asked first) and a first chunk of
what follows. The step is one ``ModelEngine.step``: one forward on every rank.

Why trace order, and why a request may wait: so the prefill tokens it computes are
exactly ``tpcache replay``'s on the same slice (prompt tokens - matched tokens), a
request is admitted only when the cache already holds everything it would match after
every earlier request: with the cache on, a request whose prompt shares more whole
pages with a prompt still in prefill than the cache holds now waits until that prefill
is done (its prompt is cached then: ``cache_unfinished``). Requests that share nothing
with those in prefill batch together. With the cache off nothing is ever cached
(requests are aborted at the end instead of finished, chunks computed without
``cache_unfinished``), so every admit misses, and no request waits.

Admission also waits while the cache could not hold the request's prompt and output
next to what the running requests still need. A client that disconnects is found when a
token cannot be sent to it (ROUTER_MANDATORY): its request is aborted, nothing held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from tpcache.cache.namespace import CacheNamespace
from tpcache.engine.forward import Chunk, Compute, Decode, ForwardOut, ModelEngine, Prefill
from tpcache.harness.gen_admit import Run, fits, would_match_more
from tpcache.harness.gen_wire import (
    Done,
    GenerateError,
    Refused,
    Submit,
    Token,
    decode_submit,
    encode,
    pack,
    unpack,
)


@dataclass(frozen=True)
class LoopConfig:
    cache: bool = True  # False: the prefix cache off (nothing cached, every admit misses)
    step_tokens: int = 256  # token budget of one step: prefill chunks and decodes
    idle_timeout_s: float = 120.0  # no message while waiting for one this long: give up
    namespace: CacheNamespace | None = None  # every request's (a tenant salt, a LoRA id)

    def __post_init__(self) -> None:
        if isinstance(self.step_tokens, bool) or not isinstance(self.step_tokens, int):
            raise GenerateError(f"step_tokens must be an int, got {self.step_tokens!r}")
        if self.step_tokens < 1:
            raise GenerateError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if not self.idle_timeout_s > 0:
            raise GenerateError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")


@dataclass
class LoopCounters:
    """Owned by the loop; read when it returns."""

    steps: int = 0
    max_batch: int = 0  # most requests in one step
    prompt_tokens: int = 0  # of admitted requests
    matched_tokens: int = 0  # taken from the cache at admission
    prefill_computed: int = 0  # prompt tokens run through the model (as the ranks said)
    decode_computed: int = 0  # generated tokens run through the model
    generated: int = 0  # tokens sent to clients
    finished: int = 0
    dropped: int = 0  # clients gone mid-request: aborted
    refused: int = 0  # malformed or unexpected submissions
    waits: int = 0  # steps in which the next request waited for a prefill (cache on)
    prefix_lens: dict[int, int] = field(default_factory=dict)  # seq -> matched


class GenLoop:
    """Serves requests ``0 .. total - 1`` arriving on ``sock`` (a bound ROUTER) with
    ``engine``'s TP group. Not thread-safe; ``serve`` runs until each request is
    finished, dropped or refused, and raises ``GenerateError`` if one never arrives
    within ``idle_timeout_s``, or the engine's errors if a step fails."""

    def __init__(
        self,
        engine: ModelEngine,
        sock: zmq.Socket,
        config: LoopConfig,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.coord = engine.coord
        self.sock = sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.config = config
        self.progress = progress
        self.counters = LoopCounters()
        self.page = self.coord.mirror.page_size
        self.arrived: dict[int, tuple[bytes, Submit]] = {}  # seq -> (client, request)
        self.seen: set[int] = set()  # seqs submitted (each is taken once)
        self.skipped: set[int] = set()  # seqs refused: admission passes over them
        self.total = 0
        self.running: dict[int, Run] = {}  # admission order
        self.next_seq = 0

    # ---- the loop ---------------------------------------------------------------------
    def serve(self, total: int) -> LoopCounters:
        c = self.counters
        self.total = total
        last = time.monotonic()
        while c.finished + c.dropped + c.refused < total:
            self._receive(total, block=False)
            work, parts = self._plan(total)
            if work:
                self._run(work, parts)
                last = time.monotonic()
                continue
            if not self._receive(total, block=True):
                if time.monotonic() - last > self.config.idle_timeout_s:
                    raise GenerateError(
                        f"request {self.next_seq} never arrived: nothing to do for "
                        f"{self.config.idle_timeout_s:g} s"
                    )
            else:
                last = time.monotonic()
        return c

    def _receive(self, total: int, block: bool) -> bool:
        """Take every waiting submission (``block``: wait up to 50 ms for one). A
        submission for no awaited request is refused and changes nothing; a malformed
        one for an awaited request is refused and that request counts as done."""
        got = False
        while self.sock.poll(50 if block and not got else 0):
            frames = self.sock.recv_multipart()
            got = True
            if len(frames) != 2:
                continue  # not a DEALER's single-frame message: nothing to answer
            ident, body = frames
            try:
                sub = decode_submit(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._send(ident, Refused(-1, f"malformed: {exc}"))
                continue
            if not 0 <= sub.seq < total or sub.seq in self.seen:
                why = f"seq {sub.seq} is not an awaited request (0..{total - 1}, each once)"
                self._send(ident, Refused(sub.seq, why))
                continue
            self.seen.add(sub.seq)
            why = _malformed(sub)
            if why:
                self.skipped.add(sub.seq)
                self.counters.refused += 1
                self._send(ident, Refused(sub.seq, why))
                continue
            self.arrived[sub.seq] = (ident, sub)
        return got

    # ---- one step -----------------------------------------------------------------------
    def _plan(self, total: int) -> tuple[list, list[tuple[Run, str]]]:
        budget = self.config.step_tokens
        work: list = []
        parts: list[tuple[Run, str]] = []
        for run in self.running.values():
            if not run.prefilling:
                work.append(Decode(run.seq, run.out[-1]))
                parts.append((run, "decode"))
                budget -= 1
        for run in self.running.values():
            if run.prefilling and budget > 0:
                n = min(run.prompt.size - run.done, budget)
                chunk = run.prompt[run.done : run.done + n]
                if self.config.cache:
                    work.append(Chunk(run.seq, run.prompt[: run.done], chunk))
                else:
                    self.coord.extend(run.seq, n)
                    work.append(Compute(run.seq, chunk))
                parts.append((run, "prefill"))
                budget -= n
        while self.next_seq in self.skipped:
            self.next_seq += 1
        while budget > 0 and self.next_seq in self.arrived:
            run = self._admit()
            if run is None:
                break
            n = min(run.prompt.size - run.prefix_len, budget)
            prompt = run.prompt[: run.prefix_len + n]
            work.append(Prefill(run.seq, prompt, namespace=self.config.namespace))
            parts.append((run, "admit"))
            budget -= n
        return work, parts

    def _admit(self) -> Run | None:
        """The next request in trace order, if it may start now (see the module
        docstring); None if it waits."""
        seq = self.next_seq
        ident, sub = self.arrived[seq]
        prompt = unpack(sub.prompt)
        mirror = self.coord.mirror
        cached = mirror.admit_prefix_len(prompt, self.config.namespace)
        running = self.running.values()
        if self.config.cache and would_match_more(running, prompt, cached, self.page):
            self.counters.waits += 1
            return None
        if not fits(running, mirror.sizes(), prompt.size + sub.max_new - 1, cached, self.page, seq):
            return None
        del self.arrived[seq]
        self.next_seq += 1
        while self.next_seq in self.skipped:
            self.next_seq += 1
        run = Run(seq, ident, prompt, sub.max_new, done=cached, prefix_len=cached)
        self.running[seq] = run
        return run

    def _run(self, work: list, parts: list[tuple[Run, str]]) -> None:
        outs = self.engine.step(work)
        c = self.counters
        c.steps += 1
        c.max_batch = max(c.max_batch, len(work))
        for (run, kind), out in zip(parts, outs, strict=True):
            if kind == "decode":
                c.decode_computed += out.computed
                self._emit(run, _sample(out))
                continue
            if kind == "admit":
                assert out.prefix_len == run.prefix_len, (out.prefix_len, run.prefix_len)
                c.prompt_tokens += run.prompt.size
                c.matched_tokens += out.prefix_len
                c.prefix_lens[run.seq] = out.prefix_len
            run.done += out.computed
            run.computed += out.computed
            c.prefill_computed += out.computed
            if not run.prefilling:
                if self.config.cache:  # the whole prompt, for the next admissions
                    self.coord.cache_unfinished(run.seq, run.prompt)
                self._emit(run, _sample(out))

    def _emit(self, run: Run, token: int) -> None:
        run.out.append(token)
        self.counters.generated += 1
        if not self._send(run.ident, Token(run.seq, len(run.out) - 1, token)):
            self._drop(run)
        elif len(run.out) == run.max_new:
            self._finish(run)

    def _finish(self, run: Run) -> None:
        del self.running[run.seq]
        if self.config.cache:
            self.coord.finish(run.seq, run.out)  # caches the tokens that have KV
        else:
            self.coord.abort(run.seq)
        self.counters.finished += 1
        out = np.asarray(run.out, dtype=np.int32)
        self._send(run.ident, Done(run.seq, pack(out), run.prefix_len, run.computed))
        if self.progress is not None:
            c = self.counters
            self.progress(c.finished + c.dropped + c.refused, self.total)

    def _drop(self, run: Run) -> None:
        del self.running[run.seq]
        self.coord.abort(run.seq)
        self.counters.dropped += 1

    def _send(self, ident: bytes, msg: Token | Done | Refused) -> bool:
        """False if the client is gone."""
        try:
            self.sock.send_multipart([ident, encode(msg)])
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise


def _malformed(sub: Submit) -> str | None:
    if sub.max_new < 1:
        return f"max_new must be >= 1, got {sub.max_new}"
    if not sub.prompt or len(sub.prompt) % 4:
        return "the prompt must be one or more int32 token ids"
    return None


def _sample(out: ForwardOut) -> int:
    """Greedy: the runner's token if it samples, else the argmax of the last logits."""
    if out.token is not None:
        return int(out.token)
    return int(np.argmax(out.logits[-1]))


__all__ = ["GenLoop", "LoopConfig", "LoopCounters"]
