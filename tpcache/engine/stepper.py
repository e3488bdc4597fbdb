"""``Stepper``: one engine step (the scheduler's cache calls, one forward, sampling and
the cache calls after it) and how requests end, for the engine's loop thread.

Every event a step makes goes to ``outbox`` at once, in order, so a step that fails half
way still tells what it decided: a token is sampled once, appended to the request's
output and queued for its sink in the same place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tpcache.coordinator.core import Coordinator
from tpcache.engine.config import EngineConfig
from tpcache.engine.errors import GenerationFailed, RequestTooLarge
from tpcache.engine.forward import ModelEngine
from tpcache.engine.live import Live
from tpcache.engine.requests import BadSampling, Failed, Finished, GenEvent, TokenOut
from tpcache.engine.sampling import sample
from tpcache.engine.scheduler import Item, Scheduler
from tpcache.engine.work import Compute, ForwardOut
from tpcache.errors import TpcacheError

PROBE_ID = "tpcache-engine-vocab-probe"  # the one-token forward that finds the vocabulary


@dataclass
class StepCounters:
    """Owned by the stepper."""

    forwards: int = 0
    max_batch: int = 0  # most requests in one forward
    prefill_tokens: int = 0  # prompt (and resumed) tokens computed
    decode_tokens: int = 0
    generated: int = 0  # tokens sent
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    recoveries: int = 0  # requests queued again after a failed step


class Stepper:
    """Not thread-safe: the loop thread's."""

    def __init__(
        self, coord: Coordinator, config: EngineConfig, model: ModelEngine, vocab: int | None
    ) -> None:
        if vocab is not None and (
            isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1
        ):
            raise BadSampling(f"vocab must be an int >= 1, got {vocab!r}")
        self.coord = coord
        self.config = config
        self.model = model
        self.vocab = vocab  # written by the loop thread once, read by submit
        self.sched = Scheduler(config)
        self.counters = StepCounters()
        self.outbox: list[tuple[Live, GenEvent, bool]] = []  # (request, event, last one)
        self.idle = False  # the last step had nothing to run
        self._probed = vocab is not None

    def take_events(self) -> list[tuple[Live, GenEvent, bool]]:
        out, self.outbox = self.outbox, []
        return out

    # ---- one step -------------------------------------------------------------------------
    def step(self, limit: int) -> None:
        """Run one step (see ``scheduler``). Raises the coordinator's and the ranks' errors
        (a failed group) with what was decided before in ``outbox``."""
        coord = self.coord
        with coord.lock:
            if not self._probed and self.sched.waiting:
                self._probe()
            with coord.batch():
                items, too_large = self.sched.plan(coord, limit)
            for live in too_large:
                why = f"request {live.rid!r} needs KV for {live.final_kv()} tokens; one may hold {limit}"
                self.end_failed(live, RequestTooLarge(why))
            self.idle = not items
            if not items:
                return
            # Greedy requests need only the argmax, which every rank sends anyway.
            outs = self.model.step(
                [Compute(i.live.rid, i.tokens, not i.live.greedy) for i in items]
            )
            self._absorb(items, outs)

    def _probe(self) -> None:
        """Learn the vocabulary from a one-token forward; refuse the waiting requests
        whose prompts fall outside it."""
        coord = self.coord
        if coord.mirror.is_running(PROBE_ID):  # left by a probe whose forward failed
            coord.abort(PROBE_ID)
        coord.admit(PROBE_ID, [0])
        try:
            out = self.model.step([Compute(PROBE_ID, [0])])[0]
        finally:
            if coord.mirror.is_running(PROBE_ID):
                coord.abort(PROBE_ID)
        self._probed = True
        if out.logits.size:
            self.vocab = int(out.logits.shape[-1])
            for live in list(self.sched.waiting):
                if max(live.req.prompt) >= self.vocab:
                    why = f"prompt token id {max(live.req.prompt)} is outside the model's vocabulary (ids 0..{self.vocab - 1})"
                    self.end_failed(live, BadSampling(why))

    def _absorb(self, items: list[Item], outs: list[ForwardOut]) -> None:
        c = self.counters
        c.forwards += 1
        c.max_batch = max(c.max_batch, len(items))
        ending: list[tuple[Live, str]] = []
        prefilled: list[Live] = []
        for item, out in zip(items, outs, strict=True):
            live = item.live
            if item.decode:
                c.decode_tokens += out.computed
            else:
                c.prefill_tokens += out.computed
                live.prefilled += out.computed
                live.done += out.computed
                if live.prefilling:
                    continue
                live.solo = False
            token = self._sample(live, out)
            live.out.append(token)
            c.generated += 1
            self.outbox.append((live, TokenOut(live.rid, len(live.out) - 1, token), False))
            if not item.decode:
                prefilled.append(live)
            reason = live.stop_reason(self.config.eos_token_ids)
            if reason is not None:
                ending.append((live, reason))
        # A prefill just done: the cache learns the rest of its tokens now (an extend
        # gives slots, not tokens), so later admissions match them and a finish keys
        # the request's KV by the tokens it was computed for, even one that ends here.
        for live in prefilled if self.config.prefix_cache else ():
            self.coord.cache_unfinished(live.rid, live.context)
        for live, reason in ending:
            self.finish(live, reason)

    def _sample(self, live: Live, out: ForwardOut) -> int:
        if out.logits.size == 0:  # greedy: the argmax; or the runner sampled itself
            token = out.argmax if live.greedy and out.argmax is not None else out.token
            assert token is not None
            return int(token)
        if self.vocab is None:
            self.vocab = int(out.logits.shape[-1])
        return sample(out.logits[-1], live.req.sampling, live.rng)

    # ---- how requests end -----------------------------------------------------------------
    def finish(self, live: Live, reason: str) -> None:
        """End ``live``: cache what it computed (the coordinator's ``finish``) and tell
        its sink. A failed group loses that KV, not the answer: it finishes anyway."""
        running = live.running
        self.sched.remove(live)
        if running:
            with contextlib.suppress(TpcacheError):  # the next step finds the group failed
                if self.config.prefix_cache:
                    self.coord.finish(
                        live.rid, live.out[live.context.size - len(live.req.prompt) :]
                    )
                else:
                    self.coord.abort(live.rid)
        if reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.finished += 1
        ev = Finished(
            live.rid,
            tuple(live.out),
            reason,
            len(live.req.prompt),
            live.prompt_cached,
            live.prefilled,
            live.preemptions,
            live.recoveries,
        )
        self._end(live, ev)

    def cancel(self, live: Live) -> None:
        """Abort ``live`` (its slots come back) and finish it as cancelled."""
        if live.ended:
            return
        if live.running:
            try:
                with self.coord.lock:
                    self.coord.abort(live.rid)
            except TpcacheError:
                pass  # lost with its group
            live.running = False
        self.finish(live, "cancelled")

    def end_failed(self, live: Live, err: TpcacheError) -> None:
        if live.running:
            try:
                with self.coord.lock:
                    if self.coord.mirror.is_running(live.rid):
                        self.coord.abort(live.rid)
            except TpcacheError:
                pass
        self.sched.remove(live)
        live.running = False
        self.counters.failed += 1
        self._end(live, Failed(live.rid, err))

    def fail_all(self, lives: list[Live], err: TpcacheError) -> None:
        for live in lives:
            if not live.ended:
                self.end_failed(live, err)

    def settle(self, why: BaseException) -> None:
        """After a failed step, with the group healthy again: queue again each running
        request that lost its KV (all of them after a recovery; after a forward the
        ranks refused, those the failed step touched: their slots have no KV), to
        resume with its prompt + tokens sent; the others go on. One re-admitted more
        than ``max_recoveries`` times fails. Raises the coordinator's errors (it failed
        again: call again once it is back; what was done stays done)."""
        coord = self.coord
        with coord.lock:
            for live in list(self.sched.running.values()):
                held = coord.mirror.is_running(live.rid)
                if held and live.rid not in self.sched.touched:
                    continue
                if held:
                    coord.abort(live.rid)
                self.sched.running.pop(live.rid)
                live.running = False
                live.recoveries += 1
                live.solo = live.recoveries >= 2
                self.counters.recoveries += 1
                if live.recoveries > self.config.max_recoveries:
                    err = GenerationFailed(
                        f"request {live.rid!r} was re-admitted {self.config.max_recoveries} "
                        f"times after failed steps; the last: {why}"
                    )
                    self.end_failed(live, err)
                else:
                    self.sched.add(live)
            self.sched.touched.clear()

    def _end(self, live: Live, ev: GenEvent) -> None:
        live.ended = True
        self.outbox.append((live, ev, True))


__all__ = ["PROBE_ID", "StepCounters", "Stepper"]
