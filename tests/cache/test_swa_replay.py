"""Trace replay through the hybrid (full + SWA) cache and ``tpcache replay --swa-window``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpcache.cli import main
from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE as TRACE
from tpcache.trace import load_trace

SAME = ("prompt_tokens", "matched_tokens", "hit_rate", "evicted_tokens", "cached_tokens_end")


def test_an_swa_pool_as_large_as_the_full_pool_replays_like_the_base_cache() -> None:
    # Every cached page has SWA KV and both pools run short together, so the hybrid
    # cache evicts exactly the base cache's leaves: same hits, same evictions.
    requests = load_trace(TRACE, 300)
    base = replay(requests, ReplayOptions(capacity=200_000, page_size=16))
    hyb = replay(requests, ReplayOptions(capacity=200_000, page_size=16, swa_window=4096))
    assert {k: hyb[k] for k in SAME} == {k: base[k] for k in SAME}
    assert base["evicted_tokens"] > 0
    assert (hyb["swa_capacity_tokens"], hyb["swa_window"]) == (200_000, 4096)
    assert hyb["swa_cached_tokens_end"] == hyb["full_cached_tokens_end"] == hyb["cached_tokens_end"]
    assert (hyb["tombstones_end"], hyb["tombstone_tokens_end"]) == (0, 0)


def test_a_small_swa_pool_hits_less_and_reports_its_pools() -> None:
    requests = load_trace(TRACE, 300)
    full = replay(requests, ReplayOptions(capacity=None, page_size=16, swa_window=1024))
    small = replay(
        requests,
        ReplayOptions(capacity=None, page_size=16, swa_window=1024, swa_capacity=150_000),
    )
    assert small["hit_rate"] < full["hit_rate"]
    assert full["evicted_tokens"] == full["swa_evicted_tokens"] == 0
    assert small["swa_cached_tokens_end"] + small["swa_free_tokens_end"] == 150_000
    assert small["swa_cached_tokens_end"] <= small["full_cached_tokens_end"]
    assert (
        small["full_cached_tokens_end"] - small["swa_cached_tokens_end"]
        == small["tombstone_tokens_end"]
    )
    assert small["swa_evicted_tokens"] >= small["evicted_tokens"] > 0


def _trace(tmp_path: Path) -> Path:
    lines = [
        {"timestamp": 0, "input_length": 900, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 2, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_cli_replays_through_the_hybrid_cache(tmp_path: Path, capsys) -> None:
    path = str(_trace(tmp_path))
    args = ["replay", path, "--capacity", "4096", "--swa-window", "256"]
    assert main([*args, "--swa-capacity", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["swa_window"], out["swa_capacity_tokens"], out["requests"]) == (256, 2048, 3)
    assert out["matched_tokens"] == 896 + 512  # request 1 reuses 56 pages, request 2 32
    for key in ("tombstones_end", "tombstone_tokens_end", "tombstoned_nodes_total"):
        assert out[key] >= 0
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "SWA window      256 tokens" in text and "tombstones" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--swa-capacity", "1024"], "--swa-capacity needs --swa-window"),
        (["--swa-window", "100"], "whole number of pages of 16"),
        (["--swa-window", "256", "--swa-capacity", "8192"], "may not be larger than the full"),
        (["--swa-window", "256", "--swa-capacity", "512"], "--swa-capacity 512 holds 512 tokens"),
    ],
)
def test_cli_rejects_bad_swa_options(tmp_path: Path, capsys, extra, message) -> None:
    path = str(_trace(tmp_path))
    assert main(["replay", path, "--capacity", "4096", *extra]) == 2
    assert message in capsys.readouterr().err
