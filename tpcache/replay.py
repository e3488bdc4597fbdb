"""Trace replay through the cache state machine alone: the figures a policy or a tree
change is judged by.

One request at a time, in file order: admit (match at most ``input_length - 1`` prompt
tokens in whole pages, lock, evict the shortfall, allocate the rest of the prompt and
the output in one allocation: ``reserve``), then finish (cache prompt + output in whole
pages, free the partial tail, unlock). Tokens follow ``tpcache.trace``'s rule, so other
tools can reproduce the numbers.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from tpcache.cache.factory import CacheSpec, build
from tpcache.cache.keys import frozen_tokens
from tpcache.cache.namespace import CacheNamespace, make_namespace
from tpcache.cache.protocol import Cache
from tpcache.cache.swa.config import HybridConfig, HybridSizes
from tpcache.trace import (
    TraceRequest,
    check_scale,
    output_tokens,
    scaled_output_length,
    scaled_prompt_tokens,
)


@dataclass(frozen=True)
class ReplayOptions:
    capacity: int | None  # tokens; None: infinite (sized to the whole replay)
    page_size: int = 16
    policy: str = "lru"
    swa_window: int | None = None  # tokens; set: replay through the hybrid (SWA) cache
    swa_capacity: int | None = None  # SWA pool tokens; None: as large as the full pool
    scale: int = 1  # k of a scale 1/k: every length divided by k (``trace.check_scale``)
    host_capacity: int | None = None  # tokens; set: a host tier behind the device pool
    write_policy: str = "write_back"  # the host tier's (``HostConfig``)
    write_through_hits: int = 2
    # One pass over the trace per salt, in one cache, each in the namespace of (lora_id,
    # that salt); none: one pass in the namespace of lora_id alone (None: the default).
    salts: tuple[str, ...] = ()
    lora_id: int | None = None

    def __post_init__(self) -> None:
        check_scale(self.scale)
        self.spaces()  # raises InvalidNamespace for a bad salt or LoRA id

    def spaces(self) -> list[CacheNamespace | None]:
        """The namespace of each pass over the trace."""
        return [make_namespace(self.lora_id, None, s) for s in self.salts or (None,)]


def infinite_capacity(requests: list[TraceRequest], page_size: int, scale: int = 1) -> int:
    """Tokens that hold every request's prompt and output (scaled by ``1/scale``) at once,
    in whole pages."""
    tokens = [-(-r.input_length // scale) + -(-r.output_length // scale) for r in requests]
    pages = sum(-(-n // page_size) for n in tokens)
    return max(pages, 1) * page_size


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def replay(
    requests: list[TraceRequest],
    opts: ReplayOptions,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` and return the summary (see ``tpcache replay --json``).

    ``progress(done, total)``, when given, is called every 100 requests and after the
    last one, outside the timed calls. With ``opts.salts``, the trace runs once per salt
    in one cache (an infinite capacity holds every pass), and ``passes`` gives each
    pass's figures."""
    capacity = opts.capacity or len(opts.spaces()) * infinite_capacity(
        requests, opts.page_size, opts.scale
    )
    cache, extra_figures = make_cache(opts, capacity)
    run = _run(cache, requests, opts, progress)
    cache.check_integrity()
    evicts = cache.evict_seconds()
    stats = cache.stats()
    return {
        "requests": len(requests),
        "page_size": opts.page_size,
        "policy": opts.policy,
        "scale": f"1/{opts.scale}",
        "capacity_tokens": capacity if opts.capacity else None,
        "prompt_tokens": run.prompt_tokens,
        "matched_tokens": run.matched,
        "hit_rate": run.matched / run.prompt_tokens if run.prompt_tokens else 0.0,
        "evicted_tokens": stats.evicted_pages[0] * opts.page_size,
        "evict_calls": stats.evict_calls,
        "cache_ops_s": sum(run.match_s) + sum(run.insert_s),
        "cache_ops_cpu_s": run.cpu_s,  # process CPU time of the same calls
        "match_us_median": _median_us(run.match_s),
        "insert_us_median": _median_us(run.insert_s),
        "evict_us_median": _median_us(evicts),
        "cached_tokens_end": cache.sizes().cached,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        **extra_figures(run.matched),
        **({"passes": pass_summary(opts, run.passes)} if opts.salts else {}),
    }


def pass_summary(opts: ReplayOptions, passes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Each salted pass's figures: its salt, prompt and matched tokens, hit rate."""
    return [
        {
            "salt": salt,
            "lora_id": opts.lora_id,
            "prompt_tokens": prompt,
            "matched_tokens": matched,
            "hit_rate": matched / prompt if prompt else 0.0,
        }
        for salt, (prompt, matched) in zip(opts.salts, passes, strict=True)
    ]


@dataclass
class _Run:
    """What the replay's loop timed and counted."""

    match_s: list[float]  # each admit's wall time
    insert_s: list[float]  # each finish's
    cpu_s: float  # process CPU time of the same calls
    prompt_tokens: int
    matched: int
    passes: list[tuple[int, int]]  # per pass (namespace): prompt tokens, matched


def _run(
    cache: Cache,
    requests: list[TraceRequest],
    opts: ReplayOptions,
    progress: Callable[[int, int], None] | None,
) -> _Run:
    """Admit and finish every request in order, once per namespace of ``opts.spaces()``
    (request ids of pass p: ``p * ids + index``), timing each call alone."""
    match_s: list[float] = []
    insert_s: list[float] = []
    prompt_total = matched = 0
    cpu_s = 0.0
    clock, cpu = time.perf_counter, time.process_time
    spaces = opts.spaces()
    ids, total = max(r.index for r in requests) + 1, len(spaces) * len(requests)
    passes: list[tuple[int, int]] = []
    for p, space in enumerate(spaces):
        before = (prompt_total, matched)
        for i, req in enumerate(requests):
            # Immutable, as a prompt decoded from a frontend's message is: the cache keeps
            # it without a copy.
            prompt = frozen_tokens(scaled_prompt_tokens(req, opts.scale))
            output = output_tokens(req)[: scaled_output_length(req, opts.scale)]
            rid = p * ids + req.index
            c0 = cpu()  # outside the wall-clock window, so it does not add to it
            t0 = clock()
            got = cache.admit(rid, prompt, reserve=output.size, namespace=space)
            t1 = clock()
            cache.finish(rid, output)
            t2 = clock()
            cpu_s += cpu() - c0
            match_s.append(t1 - t0)
            insert_s.append(t2 - t1)
            prompt_total += prompt.size
            matched += got.prefix_len
            done = p * len(requests) + i + 1
            if progress is not None and (done % 100 == 0 or done == total):
                progress(done, total)
        passes.append((prompt_total - before[0], matched - before[1]))
    return _Run(match_s, insert_s, cpu_s, prompt_total, matched, passes)


def make_cache(opts: ReplayOptions, capacity: int) -> tuple[Cache, Callable[[int], dict[str, Any]]]:
    """The cache of ``replay_spec(opts)`` (``cache.factory.build``) of ``capacity`` tokens;
    and the figures its parts add to the summary, given the matched tokens. Raises
    ``CacheError`` for a configuration it cannot build (``SwaHostTierError``, a
    ``HostTierError``, for a window and a host tier both)."""
    spec = replay_spec(opts)
    if spec.sliding_window is not None and opts.swa_capacity is not None:
        # A replay's SWA pool is the size it was given: a lockstep's is cut to the full
        # pool (its capacity is agreed later), a replay's is refused if larger.
        HybridConfig(capacity, opts.swa_capacity, spec.sliding_window, opts.page_size, opts.policy)
    cache = build(spec, capacity)
    if cache.swa is not None:
        return cache, lambda _: hybrid_summary(cache)
    if spec.host_capacity_tokens is not None:
        return cache, lambda matched: host_summary(cache, matched)
    return cache, lambda _: {}


def replay_spec(opts: ReplayOptions) -> CacheSpec:
    """The cache ``opts`` replay through (an ``swa_window`` of 0 is none, as it always
    was; ``swa_capacity`` counts only with a window)."""
    window = opts.swa_window or None
    return CacheSpec(
        page_size=opts.page_size,
        policy=opts.policy,
        sliding_window=window,
        swa_capacity_tokens=opts.swa_capacity if window else None,
        host_capacity_tokens=opts.host_capacity,
        write_policy=opts.write_policy,
        write_through_hits=opts.write_through_hits,
    )


def hybrid_summary(cache: Cache) -> dict[str, Any]:
    """The hybrid cache's extra figures: SWA pool use and tombstones at the end."""
    s = cache.sizes()
    assert isinstance(s, HybridSizes), "a cache with a window sizes its SWA pool too"
    assert cache.swa is not None, "a cache with an SWA pool has its window"
    stats = cache.stats()
    ps = cache.page_size
    return {
        "swa_window": cache.swa.window,
        "swa_capacity_tokens": s.swa.capacity,
        "full_cached_tokens_end": s.cached,
        "swa_cached_tokens_end": s.swa.cached,
        "swa_free_tokens_end": s.swa.free,
        "swa_evicted_tokens": stats.evicted_pages[1] * ps,
        "tombstones_end": s.tombstones,
        "tombstone_tokens_end": s.tombstone_tokens,
        "tombstoned_nodes_total": stats.tombstoned_nodes,
    }


def host_summary(cache: Cache, matched: int) -> dict[str, Any]:
    """The host tier's figures: hits split by tier (a host hit is loaded back: its tokens
    are the loaded ones), tokens loaded and written back."""
    assert cache.host is not None, "a cache built with a host tier reports it"
    tier = cache.host.stats()
    return {
        "host_capacity_tokens": tier.sizes.capacity,
        "write_policy": cache.config.write_policy,
        "device_hit_tokens": matched - tier.loaded_tokens,
        "host_hit_tokens": tier.loaded_tokens,
        "loaded_tokens": tier.loaded_tokens,
        "written_back_tokens": tier.written_tokens,
        "host_evicted_tokens": tier.host_evicted_tokens,
        "host_cached_tokens_end": tier.sizes.cached,
    }


def _median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 2) if values else 0.0


class Progress:
    """How far a replay has got, written to ``stream`` (stderr; stdout is kept for the
    result, which ``--json`` makes one JSON object).

    On a terminal, one counter rewritten in place. Anywhere else (a pipe, a log, CI) a
    carriage return would pile up, so it writes plain lines: the first once ``quiet_s``
    have passed (a short run prints nothing), then one every ``every_s``, and a last one
    at the end if any was written. ``tty`` defaults to ``stream.isatty()``; ``clock`` is
    read once on construction, when the run starts, and at each call. A call writes at
    most one line or counter update and raises nothing for ``0 <= done <= total``.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet_s: float = 5.0,
        every_s: float = 10.0,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.every_s = every_s
        self.started = clock()
        self.next_line = self.started + quiet_s  # set by __call__: when a plain line is due
        self.wrote = False  # set by __call__: a plain line was written

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            end = "\n" if done == total else ""
            print(f"\r  {done:,}/{total:,} requests", end=end, file=self.stream, flush=True)
            return
        now = self.clock()
        if now < self.next_line and not (done == total and self.wrote):
            return
        self.wrote = True
        self.next_line = now + self.every_s
        share = 100 * done // total if total else 100
        print(
            f"replay: {done:,}/{total:,} requests ({share}%), {now - self.started:.0f} s",
            file=self.stream,
            flush=True,
        )
