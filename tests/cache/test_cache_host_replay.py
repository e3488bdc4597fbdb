"""Trace replay with a host tier: with room for everything the two tiers lose
nothing (the ideal prefix reuse), hits split exactly into device and host, a small
device with a host behind it hits as one cache of the summed size, and the CLI's
options and refusals."""

from __future__ import annotations

import json
import subprocess
import sys

from test_cache_replay import ideal_matched_tokens

from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE as TRACE
from tpcache.trace import load_trace


def test_two_tiers_with_room_for_everything_lose_nothing() -> None:
    requests = load_trace(TRACE, 300)
    got = replay(requests, ReplayOptions(300_000, 16, host_capacity=10**8))
    assert got["evicted_tokens"] > 0  # the device did evict, to the host
    assert got["matched_tokens"] == ideal_matched_tokens(requests, 16)
    assert got["host_evicted_tokens"] == 0
    assert got["device_hit_tokens"] + got["host_hit_tokens"] == got["matched_tokens"]
    assert got["host_hit_tokens"] > 0 and got["loaded_tokens"] == got["host_hit_tokens"]
    assert got["written_back_tokens"] == got["evicted_tokens"]


def test_write_back_hits_as_one_cache_of_the_summed_size() -> None:
    requests = load_trace(TRACE, 600)
    tiered = replay(requests, ReplayOptions(200_000, 16, host_capacity=1_000_000))
    single = replay(requests, ReplayOptions(1_200_000, 16))
    small = replay(requests, ReplayOptions(200_000, 16))
    assert tiered["host_evicted_tokens"] > 0  # the host was full too
    assert tiered["device_hit_tokens"] == small["matched_tokens"]
    assert abs(tiered["hit_rate"] - single["hit_rate"]) <= 0.01
    assert tiered["hit_rate"] > small["hit_rate"] + 0.005  # the host did hit


def test_write_through_selective_copies_only_hit_nodes() -> None:
    requests = load_trace(TRACE, 300)
    opts = ReplayOptions(300_000, 16, host_capacity=10**8, write_policy="write_through_selective")
    got = replay(requests, opts)
    assert got["write_policy"] == "write_through_selective"
    assert 0 < got["written_back_tokens"] < got["evicted_tokens"]
    assert got["device_hit_tokens"] + got["host_hit_tokens"] == got["matched_tokens"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", str(TRACE), "--limit", "50", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_replay_with_a_host_tier() -> None:
    proc = cli("--capacity", "200000", "--host-capacity", "500000", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("device_hit_tokens", "host_hit_tokens", "loaded_tokens", "written_back_tokens"):
        assert isinstance(out[key], int)
    assert out["device_hit_tokens"] + out["host_hit_tokens"] == out["matched_tokens"]
    plain = json.loads(cli("--json").stdout)
    assert "host_hit_tokens" not in plain  # the tier off: the summary as before


def test_cli_replay_refuses_host_options_that_cannot_work() -> None:
    proc = cli("--write-policy", "write_back")
    assert proc.returncode == 2 and "need --host-capacity" in proc.stderr
    proc = cli("--host-capacity", "4096", "--write-through-hits", "3")
    assert proc.returncode == 2 and "write_through_selective" in proc.stderr
    proc = cli("--host-capacity", "4096", "--swa-window", "64")
    assert proc.returncode == 2 and "HostTierError" in proc.stderr
    proc = cli("--host-capacity", "8")
    assert proc.returncode == 2 and "host_capacity_tokens" in proc.stderr
