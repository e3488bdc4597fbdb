"""Trace replay through the cache: the hit rate at infinite capacity is exactly the ideal
prefix reuse, computed here independently; ``tpcache replay --json`` prints its keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE as TRACE
from tpcache.trace import load_trace, output_tokens, prompt_tokens


def ideal_matched_tokens(requests: list, page_size: int) -> int:
    """Each request reuses the longest run of its prompt's pages seen before (at most
    floor((input_length - 1) / page) pages); then every whole page of prompt + output is
    seen. Pages are named by chain ids: (id of the previous page's chain, page bytes)."""
    chains: dict[tuple[int, bytes], int] = {}
    matched = 0
    for req in requests:
        prompt = prompt_tokens(req)
        limit = (req.input_length - 1) // page_size
        cid = 0
        for j in range(limit):
            nxt = chains.get((cid, prompt[j * page_size : (j + 1) * page_size].tobytes()))
            if nxt is None:
                break
            cid = nxt
            matched += page_size
        seq = np.concatenate((prompt, output_tokens(req)))
        cid = 0
        for j in range(seq.size // page_size):
            key = (cid, seq[j * page_size : (j + 1) * page_size].tobytes())
            cid = chains.setdefault(key, len(chains) + 1)
    return matched


def test_hit_rate_at_infinite_capacity_is_the_ideal_prefix_reuse() -> None:
    requests = load_trace(TRACE, 400)
    got = replay(requests, ReplayOptions(capacity=None, page_size=16))
    ideal = ideal_matched_tokens(requests, 16)
    prompt = sum(r.input_length for r in requests)
    assert got["requests"] == 400
    assert got["prompt_tokens"] == prompt
    assert got["matched_tokens"] == ideal
    assert got["hit_rate"] == ideal / prompt
    assert got["evicted_tokens"] == 0
    assert 0.05 < got["hit_rate"] < 0.9  # the slice really reuses prefixes


def test_a_small_cache_hits_less_and_evicts() -> None:
    requests = load_trace(TRACE, 200)
    inf = replay(requests, ReplayOptions(capacity=None, page_size=16))
    small = replay(requests, ReplayOptions(capacity=300_000, page_size=16))
    assert small["evicted_tokens"] > 0
    assert small["matched_tokens"] < inf["matched_tokens"]
    assert small["cached_tokens_end"] <= 300_000


def test_cli_replay_json_prints_the_required_keys() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", str(TRACE), "--limit", "50", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    out = json.loads(proc.stdout)
    required = [
        "requests",
        "prompt_tokens",
        "matched_tokens",
        "hit_rate",
        "evicted_tokens",
        "cache_ops_s",
        "match_us_median",
        "insert_us_median",
        "evict_us_median",
        "peak_rss_mb",
    ]
    assert set(required) <= set(out)
    assert out["requests"] == 50
    assert out["matched_tokens"] == ideal_matched_tokens(load_trace(TRACE, 50), 16)
    assert out["cache_ops_s"] > 0 and out["peak_rss_mb"] > 0
    assert 0 < out["cache_ops_cpu_s"] < 10 * out["cache_ops_s"] + 1


def test_cli_replay_rejects_a_bad_policy(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", str(trace), "--policy", "nope", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "unknown policy" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", str(trace), "--page-size", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert json.loads(proc.stdout)["prompt_tokens"] == 3
