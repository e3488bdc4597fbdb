"""The built-in demo frontend: drives a TP group with a trace and proves lockstep held.

With a Mooncake trace it replays it exactly as ``tpcache replay`` does (same tokens,
same order, same capacity rule), so the two hit rates can be compared; without one it
runs a synthetic multi-turn chat workload. Each step carries ``batch`` requests: admit,
extend by the output, finish.

Two latencies are reported, as they answer different questions: ``step_submit_ms`` is
what a frontend waits for the calls of one step (the mirror answers at once; the step
then waits only when the pipeline is full), and ``step_latency_ms`` runs from a step's
close to every rank's verified result, so under a load submitted as fast as it goes it
is mostly queueing behind the steps sent before it (up to ``max_inflight`` messages of
up to ``coalesce`` steps).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpcache.coordinator.core import Coordinator


@dataclass(frozen=True)
class DemoRequest:
    rid: int
    prompt: np.ndarray
    output: np.ndarray


def synthetic_chat(
    conversations: int = 48, turns: int = 4, system: int = 512, seed: int = 0
) -> list[DemoRequest]:
    """Multi-turn chats sharing one system prompt: each turn's prompt is the previous
    turn's prompt + its answer + a new user message. Interleaved across conversations."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(1, 50_000, size=system, dtype=np.int64)
    history = [sys_prompt.copy() for _ in range(conversations)]
    out: list[DemoRequest] = []
    for _turn in range(turns):
        for c in range(conversations):
            user = rng.integers(1, 50_000, size=int(rng.integers(32, 256)), dtype=np.int64)
            prompt = np.concatenate((history[c], user))
            answer = rng.integers(1, 50_000, size=int(rng.integers(16, 128)), dtype=np.int64)
            out.append(DemoRequest(len(out), prompt.astype(np.int32), answer.astype(np.int32)))
            history[c] = np.concatenate((prompt, answer))
    return out


def trace_requests(path: str, limit: int | None) -> list[DemoRequest]:
    from tpcache.trace import load_trace, output_tokens, prompt_tokens

    return [
        DemoRequest(r.index, prompt_tokens(r), output_tokens(r)) for r in load_trace(path, limit)
    ]


def needed_capacity(requests: list[DemoRequest], page_size: int) -> int:
    """Tokens that hold every request at once, in whole pages (the 'inf' capacity)."""
    pages = sum(-(-(r.prompt.size + r.output.size) // page_size) for r in requests)
    return max(pages, 1) * page_size


def _chunks(requests: list[DemoRequest], size: int) -> Iterator[list[DemoRequest]]:
    for i in range(0, len(requests), size):
        yield requests[i : i + size]


# progress(requests submitted, requests in all, steps verified by every rank so far)
DemoProgress = Callable[[int, int, int], None]


def run_demo(
    coord: Coordinator,
    requests: list[DemoRequest],
    batch: int = 8,
    progress: DemoProgress | None = None,
) -> dict[str, Any]:
    """Drive ``coord`` with ``requests``; returns the summary (hit rate, steps, latency,
    rank digests). ``progress`` is called after every step but the last, and once when
    every rank has verified every step. Raises the coordinator's errors if lockstep
    breaks."""
    prompt_tokens = matched = done = 0
    step_s: list[float] = []
    before = coord.stats()  # a host tier's counters: this run's are the difference
    started = time.perf_counter()
    for chunk in _chunks(requests, batch):
        t0 = time.perf_counter()
        with coord.batch():
            for r in chunk:
                got = coord.admit(r.rid, r.prompt)
                coord.extend(r.rid, int(r.output.size))
                coord.finish(r.rid, r.output)
                prompt_tokens += int(r.prompt.size)
                matched += got.prefix_len
        step_s.append(time.perf_counter() - t0)
        done += len(chunk)
        if progress is not None and done < len(requests):
            progress(done, len(requests), coord.counters.steps_done)
    coord.sync()
    elapsed = time.perf_counter() - started
    digests = [int(d) for d in coord.ranks.call("digest")]
    stats = coord.stats()
    mirror = coord.mirror.digest()
    if progress is not None:
        progress(len(requests), len(requests), stats["steps_done"])
    return {
        "tp": coord.ranks.world_size,
        "requests": len(requests),
        "steps": stats["steps_done"],
        "ops": stats["ops"],
        "prompt_tokens": prompt_tokens,
        "matched_tokens": matched,
        "hit_rate": matched / prompt_tokens if prompt_tokens else 0.0,
        "evicted_tokens": stats["evicted_tokens"],
        "capacity_tokens": stats["capacity"],
        "elapsed_s": elapsed,
        "steps_per_s": stats["steps_done"] / elapsed if elapsed else 0.0,
        "step_submit_ms_median": statistics.median(step_s) * 1e3 if step_s else 0.0,
        "step_latency_ms_median": stats["step_latency_ms_median"],
        "divergences": stats["divergences"],
        "rank_paths": stats["rank_paths"],
        "rank_digests": digests,
        "mirror_digest": mirror,
        "lockstep_verified": all(d == mirror for d in digests) and stats["divergences"] == 0,
        **host_summary(before, stats, matched),
    }


def host_summary(before: dict, after: dict, matched: int) -> dict:
    """A host tier's figures over a run, from ``stats()`` before and after it
    (``tpcache replay --json``'s names), none without one: the run's ``matched`` tokens
    split by tier (a host hit is loaded back), tokens written back and dropped."""
    if "host_capacity" not in after:
        return {}

    def ran(key: str) -> int:
        return after[key] - before.get(key, 0)

    host = ran("host_hit_tokens")
    return {
        "host_capacity_tokens": after["host_capacity"],
        "device_hit_tokens": matched - host,
        "host_hit_tokens": host,
        "loaded_tokens": host,
        "written_back_tokens": ran("written_back_tokens"),
        "host_evicted_tokens": ran("host_evicted_tokens"),
    }
