"""``Scheduler``: who runs in the next step, and the cache calls that give them slots.

A step is filled in this order, under ``step_tokens`` and ``max_batch``: one decode for
every running request that is generating (oldest first); the next chunk of every
running request still in prefill; then waiting requests in submission order (a
preempted or recovered one keeps its place, so it goes first), each admitted with its
whole cached prefix and a first chunk of what follows. The first waiting request that
may not start stops admission (no overtaking: a large request is not starved).

When the cache runs out of room for a running request's slots (``OutOfCapacity`` from
``extend``), the newest running request is preempted: it gives its slots back (a
generating one is finished into the cache, so its resume may hit its own prefix; one
with slots but no KV yet is aborted) and waits again, keeping its tokens; on resume it
is admitted with prompt + generated tokens. New requests are admitted while their
context fits next to one page per running request (``ordered_admission``: next to all
that running requests may still need, and only once the cache holds what a request
would match after the prefills before it, as ``tpcache generate`` does).

A request that was in two failed steps in a row (``Live.solo``) has its prefill run in
steps of its own, before anything else: if its prompt is what the ranks refuse, it
fails alone, and the requests beside it go on.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from tpcache.cache.errors import OutOfCapacity
from tpcache.coordinator.core import Coordinator
from tpcache.engine.config import EngineConfig
from tpcache.engine.errors import RequestTooLarge
from tpcache.engine.live import Live, pages


@dataclass(eq=False)
class Item:
    """One request's part of a step: the tokens it computes."""

    live: Live
    tokens: np.ndarray
    decode: bool


@dataclass
class ScheduleCounters:
    """Owned by the scheduler."""

    preemptions: int = 0
    waits: int = 0  # steps where ordered admission held the next request for a prefill
    cached_tokens: int = 0  # prefix tokens taken from the cache at admissions


class Scheduler:
    """Waiting and running requests. Not thread-safe: the engine's loop thread calls it
    with the coordinator's lock held."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: list[Live] = []  # by seq
        self.running: dict[str | int, Live] = {}  # by admission
        self.counters = ScheduleCounters()
        # Requests the current step made cache calls for (kept when the step fails).
        self.touched: set[str | int] = set()

    def add(self, live: Live) -> None:
        """Queue ``live`` (new, preempted or recovered) in submission order."""
        live.running = False
        live.done = 0
        bisect.insort(self.waiting, live, key=lambda x: x.seq)

    def remove(self, live: Live) -> None:
        """Forget ``live`` (its coordinator state is the caller's)."""
        self.running.pop(live.rid, None)
        if live in self.waiting:
            self.waiting.remove(live)

    # ---- one step -------------------------------------------------------------------------
    def plan(self, coord: Coordinator, limit: int) -> tuple[list[Item], list[Live]]:
        """Make the cache calls of the next step; returns its items (oldest first) and
        the waiting requests that can never fit in ``limit`` tokens (removed). Raises the
        coordinator's errors (a failed group) with the calls before applied."""
        budget = self.config.step_tokens
        step: dict[str | int, Item] = {}
        self.touched.clear()
        solo = next((r for r in self.running.values() if r.solo), None)
        if solo is not None:  # its prefill runs alone (see ``Live.solo``)
            self._chunk(coord, solo, budget, step)
            return list(step.values()), []
        solo = next((w for w in self.waiting if w.solo), None)
        if solo is not None:
            too_large = self._admit(coord, limit, budget, step, [solo])
            if step or too_large:
                return list(step.values()), too_large
        budget -= self._decodes(coord, step)
        for live in list(self.running.values()):
            if live.running and live.prefilling and budget > 0:
                budget -= self._chunk(coord, live, budget, step)
        too_large = self._admit(coord, limit, budget, step, list(self.waiting))
        return list(step.values()), too_large

    def _decodes(self, coord: Coordinator, step: dict) -> int:
        """A slot for each generating request, in order, into ``step``; returns how many
        got one. All in one coordinator call while the cache has room; a request it has
        none for goes through ``_extend``, which preempts."""
        pending = [r for r in self.running.values() if r.running and not r.prefilling]
        added = 0
        while pending:
            done = coord.extend_each([r.rid for r in pending], 1)
            for live in pending[:done]:
                self.touched.add(live.rid)
                step[live.rid] = _decode(live)
            added += done
            if done == len(pending):
                break
            live = pending[done]
            if self._extend(coord, live, 1, step):
                step[live.rid] = _decode(live)
                added += 1
            # a preempted request (this one or a newer one) decodes no more this step
            pending = [r for r in pending[done + 1 :] if r.running]
        return added

    def _chunk(self, coord: Coordinator, live: Live, budget: int, step: dict) -> int:
        """The next prefill chunk of running ``live`` (at most ``budget`` tokens) into
        ``step``; returns its length (0 if ``live`` was preempted)."""
        n = min(live.context.size - live.done, budget)
        self.touched.add(live.rid)
        if live.done and self.config.prefix_cache:  # its KV so far, for others to match
            coord.cache_unfinished(live.rid, live.context[: live.done])
        if not self._extend(coord, live, n, step):
            return 0
        step[live.rid] = Item(live, live.context[live.done : live.done + n], False)
        return n

    def _extend(self, coord: Coordinator, live: Live, n: int, step: dict) -> bool:
        """``n`` slots for running ``live``, preempting the newest running requests while
        the cache has no room; False if ``live`` itself was preempted."""
        self.touched.add(live.rid)
        while True:
            try:
                coord.extend(live.rid, n)
                return True
            except OutOfCapacity:
                victim = max(self.running.values(), key=lambda x: x.seq)
                self.preempt(coord, victim, in_step=victim.rid in step)
                step.pop(victim.rid, None)
                if victim is live:
                    return False

    def preempt(self, coord: Coordinator, live: Live, in_step: bool) -> None:
        """Give ``live``'s slots back and queue it again (it keeps its tokens)."""
        if in_step or live.prefilling or not self.config.prefix_cache:
            coord.abort(live.rid)  # slots without KV must not be cached
        else:
            coord.finish(live.rid, live.out[live.context.size - len(live.req.prompt) :])
        del self.running[live.rid]
        live.preemptions += 1
        self.counters.preemptions += 1
        self.add(live)

    def _admit(
        self, coord: Coordinator, limit: int, budget: int, step: dict, order: list[Live]
    ) -> list[Live]:
        """Admit from ``order`` (waiting requests) while they may start; returns those
        that never can (removed from the queue)."""
        cfg = self.config
        too_large: list[Live] = []
        for live in order:
            if budget <= 0 or len(self.running) >= cfg.max_batch or len(step) >= cfg.max_batch:
                break
            if live.solo and step:
                break  # it starts alone
            if live.final_kv() > limit:
                self.waiting.remove(live)
                too_large.append(live)
                continue
            context = live.resume_tokens()
            mirror = coord.mirror
            cached = mirror.admit_prefix_len(context, cfg.namespace)
            if not self._may_start(coord, live, context, cached):
                break
            n = min(context.size - cached, budget)
            self.touched.add(live.rid)
            try:
                got = coord.admit(live.rid, context[: cached + n], namespace=cfg.namespace)
            except OutOfCapacity:
                break
            self.waiting.remove(live)
            live.context, live.running, live.done = context, True, got.prefix_len
            if not live.preemptions and not live.recoveries:
                live.prompt_cached = got.prefix_len
            live.cached = got.prefix_len
            self.counters.cached_tokens += got.prefix_len
            self.running[live.rid] = live
            step[live.rid] = Item(live, context[got.prefix_len : cached + n], False)
            budget -= cached + n - got.prefix_len
            if live.solo:
                break
        return too_large

    def _may_start(self, coord: Coordinator, live: Live, context: np.ndarray, cached: int) -> bool:
        """Whether ``live`` may be admitted now (see the module docstring)."""
        if not self.running:
            return True  # alone it fits: its final size is within the request limit
        ps = coord.mirror.page_size
        sizes = coord.mirror.sizes()
        room = (sizes.free + sizes.evictable) // ps
        if not self.config.ordered_admission:
            return pages(context.size, ps) - cached // ps + len(self.running) <= room
        cache = self.config.prefix_cache
        if cache and would_match_more(self.running.values(), context, cached, ps):
            self.counters.waits += 1
            return False
        pending = sum(
            pages(r.final_kv(), ps) - pages(r.held_kv(), ps) for r in self.running.values()
        )
        return pages(live.final_kv(), ps) - cached // ps + pending <= room


def _decode(live: Live) -> Item:
    """The decode item of generating ``live``: its newest token, whose slot it was given."""
    return Item(live, np.asarray(live.out[-1:], np.int32), True)


def would_match_more(running, context: np.ndarray, cached: int, ps: int) -> bool:
    """Whether a context still in prefill shares more whole pages (of ``ps`` tokens) with
    ``context`` than the cache gives it now (``cached``; an admit matches at most
    len - 1 tokens)."""
    bound = (context.size - 1) // ps * ps
    for run in running:
        if not run.prefilling:
            continue
        n = min(bound, run.context.size // ps * ps)
        if n <= cached:
            continue
        diff = np.flatnonzero(run.context[:n] != context[:n])
        if (int(diff[0]) if diff.size else n) // ps * ps > cached:
            return True
    return False


__all__ = ["Item", "RequestTooLarge", "ScheduleCounters", "Scheduler", "would_match_more"]
