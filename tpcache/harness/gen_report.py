"""What ``tpcache generate`` reports (``generate.py``): each mode's figures, read from
the loop's counters, the clients' own times and the group's state at the end, and the
run's summary against what ``tpcache replay`` predicts for the same slice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tpcache.coordinator.build import GroupConfig
    from tpcache.coordinator.core import Coordinator
    from tpcache.harness.gen_loop import LoopCounters
    from tpcache.harness.gen_options import GenerateOptions, GenRequest
    from tpcache.harness.gen_wire import ClientResult

REFERENCE = "tpcache.model.reference:ReferenceRunner"


def mode_summary(
    coord: Coordinator, c: LoopCounters, results: list[ClientResult], e2e: float
) -> dict[str, Any]:
    coord.sync()
    digests = [int(d) for d in coord.ranks.call("digest")]
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    lat = np.array([r.e2e_s for r in results]) * 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if a.size else 0.0  # noqa: E731
    return {
        "e2e_s": round(e2e, 3),
        "prompt_tokens": c.prompt_tokens,
        "matched_tokens": c.matched_tokens,
        "hit_rate": c.matched_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "prefill_tokens_computed": c.prefill_computed,
        "decode_tokens_computed": c.decode_computed,
        "generated_tokens": c.generated,
        "tokens_per_s": round(c.generated / e2e, 2) if e2e else 0.0,
        "computed_tokens_per_s": round((c.prefill_computed + c.decode_computed) / e2e, 1),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "latency_ms_p50": pct(lat, 50),
        "steps": c.steps,
        "max_batch": c.max_batch,
        "admission_waits": c.waits,
        "finished": c.finished,
        "dropped": c.dropped,
        "refused": c.refused,
        "held_tokens_end": coord.mirror.sizes().held,
        "rank_digests_equal": all(d == coord.mirror.digest() for d in digests),
        "prefix_lens": c.prefix_lens,
    }


def summarize(
    requests: list[GenRequest],
    opts: GenerateOptions,
    config: GroupConfig,
    modes: dict[str, dict[str, Any]],
    want: dict[str, Any],
) -> dict[str, Any]:
    on, off = modes["cache"], modes["no_cache"]
    hit = on["hit_rate"]
    expected = want["prompt_tokens"] - want["matched_tokens"]
    ratio = on["e2e_s"] / off["e2e_s"] if off["e2e_s"] else 0.0
    for m in modes.values():
        m.pop("prefix_lens")
    return {
        "requests": len(requests),
        "scale": f"1/{opts.scale}",
        "page_size": opts.page_size,
        "policy": opts.policy,
        "capacity_tokens": config.capacity_tokens,
        "tp": opts.tp,
        "ranks": "threads (gloo)",
        "clients": opts.clients,
        "step_tokens": opts.step_tokens,
        "model": {"runner": REFERENCE, **config.runner_args},
        "cache": on,
        "no_cache": off,
        "replay_prompt_tokens": want["prompt_tokens"],
        "replay_matched_tokens": want["matched_tokens"],
        "prefill_equals_replay": on["prefill_tokens_computed"] == expected
        and on["prompt_tokens"] == want["prompt_tokens"],
        "time_ratio": round(ratio, 4),
        "time_target": round(1 - hit / 2, 4),
        "time_within_target": ratio <= 1 - hit / 2,
        "nothing_held": on["held_tokens_end"] == off["held_tokens_end"] == 0,
        "rank_digests_equal": on["rank_digests_equal"] and off["rank_digests_equal"],
    }
