"""The serving loop of ``tpcache generate``: the product's ``Engine`` (continuous
batching over a ``ModelEngine``), fed by clients over ZMQ (``gen_wire``). The engine
runs the steps on its own thread; this loop takes the clients' submissions, hands them
to the engine in trace order, and sends each token back as the engine samples it.

The engine runs with ``ordered_admission`` (``engine/scheduler.py`` says how): requests
are submitted in trace order (``Submit.seq``), and a request is admitted only when the
cache already holds everything it would match after every earlier request, so the
prefill tokens it computes are exactly ``tpcache replay``'s on the same slice (prompt
tokens - matched tokens); requests that share nothing with those in prefill batch
together, and admission also waits while the cache could not hold a request's prompt
and output next to what the running requests still need. With the cache off
(``prefix_cache=False``) nothing is ever cached, so every admit misses.

A client that disconnects is found when a token cannot be sent to it
(ROUTER_MANDATORY): its request is cancelled, nothing held.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from tpcache.cache.namespace import CacheNamespace
from tpcache.engine import requests as rq
from tpcache.engine.forward import ModelEngine
from tpcache.engine.loop import Engine, EngineConfig
from tpcache.errors import TpcacheError
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
    dropped: int = 0  # clients gone mid-request: cancelled
    refused: int = 0  # malformed or unexpected submissions
    waits: int = 0  # steps in which the next request waited for a prefill (cache on)
    prefix_lens: dict[int, int] = field(default_factory=dict)  # seq -> matched


class GenLoop:
    """Serves requests ``0 .. total - 1`` arriving on ``sock`` (a bound ROUTER) with
    ``engine``'s TP group. Not thread-safe; ``serve`` runs until each request is
    finished, dropped or refused, and raises ``GenerateError`` if one never arrives
    within ``idle_timeout_s``, cannot fit in the cache, or fails in the engine."""

    def __init__(
        self,
        engine: ModelEngine,
        sock: zmq.Socket,
        config: LoopConfig,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.coord = engine.coord
        self.timeout_s = engine.timeout_s
        self.sock = sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.config = config
        self.progress = progress
        self.counters = LoopCounters()
        self.arrived: dict[int, tuple[bytes, Submit]] = {}  # seq -> (client, request)
        self.seen: set[int] = set()  # seqs submitted (each is taken once)
        self.skipped: set[int] = set()  # seqs refused: submission passes over them
        self.clients: dict[int, bytes] = {}  # seq -> client, while its request is live
        self.gone: set[int] = set()  # seqs whose client left: cancelled
        self.next_seq = 0
        self.total = 0
        self.events: queue.SimpleQueue[rq.GenEvent] = queue.SimpleQueue()

    # ---- the loop ---------------------------------------------------------------------
    def serve(self, total: int) -> LoopCounters:
        self.total = total
        c = self.config
        engine = Engine(
            self.coord,
            EngineConfig(
                step_tokens=c.step_tokens,
                timeout_s=self.timeout_s,
                ordered_admission=True,
                prefix_cache=c.cache,
                namespace=c.namespace,
            ),
        )
        wake_r, wake_w = os.pipe()  # the engine's thread wakes this one per event

        def sink(ev: rq.GenEvent) -> None:
            self.events.put(ev)
            os.write(wake_w, b"\0")

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        engine.start()
        try:
            self._serve(total, engine, sink, poller, wake_r)
        finally:
            engine.close()
            os.close(wake_r)
            os.close(wake_w)
        self._take_figures(engine)
        return self.counters

    def _serve(self, total: int, engine: Engine, sink, poller, wake_r: int) -> None:
        n = self.counters
        last = time.monotonic()
        forwards = 0
        while n.finished + n.dropped + n.refused < total:
            ready = dict(poller.poll(50))
            if wake_r in ready:
                os.read(wake_r, 4096)
            if self.sock in ready:
                self._receive(total)
                self._submit(engine, sink)
            if self._answer(engine) or ready or engine.stats()["forwards"] != forwards:
                last = time.monotonic()
                forwards = engine.stats()["forwards"]  # a long prefill is progress too
            elif time.monotonic() - last > self.config.idle_timeout_s:
                raise GenerateError(
                    f"request {self.next_seq} never arrived: nothing to do for "
                    f"{self.config.idle_timeout_s:g} s"
                )

    def _receive(self, total: int) -> None:
        """Take every waiting submission. A submission for no awaited request is refused
        and changes nothing; a malformed one for an awaited request is refused and that
        request counts as done."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
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

    def _submit(self, engine: Engine, sink) -> None:
        """Hand the arrived requests to the engine in trace order."""
        while True:
            while self.next_seq in self.skipped:
                self.next_seq += 1
            if self.next_seq not in self.arrived:
                return
            seq = self.next_seq
            ident, sub = self.arrived.pop(seq)
            prompt = tuple(int(t) for t in unpack(sub.prompt))
            sampling = rq.SamplingParams(max_new_tokens=sub.max_new, ignore_eos=True)
            try:
                engine.submit(rq.GenerateRequest(seq, prompt, sampling), sink)
            except TpcacheError as exc:
                raise GenerateError(f"request {seq} cannot be served: {exc}") from exc
            self.clients[seq] = ident
            self.next_seq += 1

    def _answer(self, engine: Engine) -> bool:
        """Send the engine's events to their clients; whether there were any."""
        got = False
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return got
            got = True
            seq = int(ev.rid)
            match ev:
                case rq.TokenOut(index=index, token=token):
                    self.counters.generated += 1
                    sent = seq in self.gone or self._send(
                        self.clients[seq], Token(seq, index, token)
                    )
                    if not sent:
                        self.gone.add(seq)
                        engine.cancel(seq)
                case rq.Finished():
                    self._finished(seq, ev)
                case rq.Failed(error=err):
                    raise GenerateError(f"request {seq} failed: {err}")

    def _finished(self, seq: int, ev: rq.Finished) -> None:
        c = self.counters
        ident = self.clients.pop(seq)
        c.prompt_tokens += ev.prompt_tokens
        c.matched_tokens += ev.cached_tokens
        c.prefix_lens[seq] = ev.cached_tokens
        if seq in self.gone:
            c.dropped += 1
            return
        c.finished += 1
        out = np.asarray(ev.tokens, dtype=np.int32)
        computed = ev.prompt_tokens - ev.cached_tokens
        self._send(ident, Done(seq, pack(out), ev.cached_tokens, computed))
        if self.progress is not None:
            self.progress(c.finished + c.dropped + c.refused, self.total)

    def _take_figures(self, engine: Engine) -> None:
        st = engine.stats()
        c = self.counters
        c.steps = st["forwards"]
        c.max_batch = st["max_batch"]
        c.prefill_computed = st["prefill_tokens"]
        c.decode_computed = st["decode_tokens"]
        c.waits = st["waits"]

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


__all__ = ["GenLoop", "LoopConfig", "LoopCounters"]
