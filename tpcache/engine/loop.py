"""``Engine``: the serving loop. Requests come in from any thread (``submit``); one loop
thread runs the steps (``scheduler`` decides who runs, ``forward.ModelEngine`` computes),
samples each request's next token on the coordinator's side (``sampling``) and tells
the request's sink.

Each step holds the coordinator's lock from its first cache call to the end of its
forward and the cache calls after it, so no other caller's calls interleave. Events are
given to sinks after the lock is let go.

A failed step (a rank died or hung, the group is being recovered, the ranks refused a
forward) loses the running requests' KV, never their tokens: the engine waits until the
coordinator is healthy again (``recovery.wait_healthy``), then queues every running
request again with its prompt + the tokens already sent, and it continues where it
stopped; its stream only pauses. A request re-admitted after ``max_recoveries``
failures, or whose group does not come back, ends with ``GenerationFailed``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from tpcache.cache.reqtable import check_request_id
from tpcache.coordinator.core import Coordinator
from tpcache.engine.config import EngineConfig
from tpcache.engine.errors import (
    DuplicateRequest,
    EngineClosed,
    GenerationFailed,
    NotAnEngineConfig,
    RequestTooLarge,
)
from tpcache.engine.forward import ModelEngine
from tpcache.engine.live import Live
from tpcache.engine.recovery import GroupDown, wait_healthy
from tpcache.engine.requests import BadSampling, GenerateRequest, GenEvent
from tpcache.engine.stepper import Stepper
from tpcache.errors import TpcacheError

DEFAULT_CONFIG = EngineConfig()


class Engine:
    """Continuous batching of generate requests over one coordinator's TP group.

    Thread-safe: ``submit``, ``cancel``, ``stats`` and ``close`` may be called from any
    thread; the loop thread (``start``) is the only one that calls the coordinator for
    requests and the only one that calls sinks.
    """

    def __init__(
        self, coord: Coordinator, config: EngineConfig = DEFAULT_CONFIG, *, vocab: int | None = None
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise NotAnEngineConfig(f"config must be an EngineConfig, got {type(config).__name__}")
        self.coord = coord
        self.config = config
        self.stepper = Stepper(coord, config, ModelEngine(coord, timeout_s=config.timeout_s), vocab)
        self._cv = threading.Condition()
        # Under _cv: written by submit/cancel/close, taken by the loop thread.
        self._incoming: list[Live] = []
        self._cancels: set[str | int] = set()
        self._live: dict[str | int, Live] = {}  # every request not yet ended
        self._closed = False
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._limit = coord.request_limit()  # refreshed by the loop after a recovery

    # ---- the API --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (a daemon). Raises ``EngineClosed`` after ``close``;
        a second call does nothing."""
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tpcache-engine", daemon=True
                )
                self._thread.start()

    def submit(self, request: GenerateRequest, sink: Callable[[GenEvent], None]) -> None:
        """Queue ``request``; ``sink`` then gets (from the loop thread) a ``TokenOut`` per
        token and exactly one ``Finished`` or ``Failed``. ``sink`` must not block; if it
        raises, the request is cancelled.

        Raises, before anything is queued or held: ``BadSampling`` (not a request, or a
        token id outside the model's vocabulary when it is known), ``DuplicateRequest``
        (its id is live), ``RequestTooLarge`` (prompt + max_new_tokens - 1 tokens of KV
        exceed what one request may hold), ``EngineClosed``, the cache's ``CacheError``
        for an id it cannot carry."""
        if not isinstance(request, GenerateRequest):
            raise BadSampling(f"submit takes a GenerateRequest, got {type(request).__name__}")
        if not callable(sink):
            raise BadSampling("sink must be callable")
        check_request_id(request.rid)
        vocab = self.stepper.vocab
        if vocab is not None and max(request.prompt) >= vocab:
            raise BadSampling(
                f"prompt token id {max(request.prompt)} is outside the model's vocabulary "
                f"(ids 0..{vocab - 1})"
            )
        s = request.sampling
        need = len(request.prompt) + s.max_new_tokens - 1
        if need > self._limit:
            raise RequestTooLarge(
                f"request {request.rid!r} needs KV for {need} tokens (prompt {len(request.prompt)}"
                f" + max_new_tokens {s.max_new_tokens} - 1); one request may hold {self._limit}"
            )
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        with self._cv:
            if self._closed:
                raise EngineClosed(f"the engine is closed: request {request.rid!r} refused")
            if request.rid in self._live:
                raise DuplicateRequest(f"request {request.rid!r} is live already")
            live = Live(request, sink, self._seq, np.random.default_rng(seed))
            self._seq += 1
            self._live[request.rid] = live
            self._incoming.append(live)
            self._cv.notify_all()

    def cancel(self, rid: str | int) -> bool:
        """Cancel a live request: its slots come back and its sink gets
        ``Finished(reason="cancelled")`` from the loop thread. False if ``rid`` is not
        live (unknown or ended)."""
        with self._cv:
            if rid not in self._live or self._closed:
                return False
            self._cancels.add(rid)
            self._cv.notify_all()
            return True

    def close(self) -> None:
        """Stop the loop thread; live requests get ``Failed(EngineClosed)``. Idempotent.
        Waits for a step in progress up to the forward timeout (a hung rank's forward:
        then the loop fails them itself when it comes back)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is None:
            self._fail_all(EngineClosed("the engine was closed"))
        elif thread is not threading.current_thread():
            thread.join(self.config.timeout_s + 5.0)

    def stats(self) -> dict[str, Any]:
        """The engine's figures (a new dict; changes nothing)."""
        with self._cv:
            out: dict[str, Any] = asdict(self.stepper.counters)
            sched = self.stepper.sched
            out.update(asdict(sched.counters))
            out["running"] = len(sched.running)
            out["waiting"] = len(sched.waiting) + len(self._incoming)
            out["live"] = len(self._live)
            out["vocab"] = self.stepper.vocab
            out["closed"] = self._closed
            return out

    # ---- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            failed = 0  # steps failed in a row
            while self._take():
                try:
                    self.stepper.step(self._limit)
                    failed = 0
                except Exception as exc:  # a failed group, or a bug: its requests may fail
                    failed += 1
                    if failed > self.config.max_recoveries + 1:  # no request to blame
                        self._fail_live(GenerationFailed(f"every step fails: {exc}"))
                        failed = 0
                    else:
                        self._recover(exc)
                self._deliver()
        finally:
            self._fail_all(EngineClosed("the engine was closed"))

    def _take(self) -> bool:
        """Move submissions and cancellations in; wait while there is nothing to do.
        False once closed."""
        with self._cv:
            while True:
                if self._closed:
                    return False
                for live in self._incoming:
                    self.stepper.sched.add(live)
                self._incoming.clear()
                cancels, self._cancels = self._cancels, set()
                sched = self.stepper.sched
                if cancels or sched.running or sched.waiting:
                    break
                self._cv.wait(0.5)
        for rid in cancels:
            live = self._live.get(rid)
            if live is not None:
                self.stepper.cancel(live)
        if self.stepper.idle:
            with self._cv:  # nothing could start (e.g. no room): wait for a change
                self._cv.wait(0.02)
        return True

    def _recover(self, exc: Exception) -> None:
        """A step failed: wait for a healthy group, then queue again the running requests
        that lost their KV (``Stepper.settle``). If the group does not come back, every
        live request fails."""
        st = self.stepper
        deadline = time.monotonic() + self.config.recovery_wait_s
        while True:
            try:
                wait_healthy(self.coord, deadline - time.monotonic(), lambda: self._closed)
                st.settle(exc)
                self._limit = self.coord.request_limit()
                return
            except GroupDown as down:
                if self._closed:
                    self._fail_live(EngineClosed("the engine was closed"))
                else:
                    self._fail_live(GenerationFailed(f"{down}; after {exc}"))
                return
            except TpcacheError as again:  # it failed again meanwhile: wait again
                exc = again

    def _deliver(self) -> None:
        """Give the step's events to their sinks; a sink that raises cancels its request."""
        for live, event, final in self.stepper.take_events():
            if final:
                with self._cv:
                    self._live.pop(live.rid, None)
            try:
                live.sink(event)
            except Exception:
                if not final:
                    self.cancel(live.rid)

    def _fail_live(self, err: TpcacheError) -> None:
        """End every request the scheduler holds with ``err``."""
        st = self.stepper
        for live in [*st.sched.running.values(), *st.sched.waiting]:
            st.end_failed(live, err)

    def _fail_all(self, err: TpcacheError) -> None:
        with self._cv:
            self._closed = True
            self._incoming.clear()
        self.stepper.fail_all(list(self._live.values()), err)
        self._deliver()


__all__ = ["Engine", "EngineConfig", "RequestTooLarge"]
