"""A trace replayed twice in one cache under two tenant salts: no hit crosses from
one salt to the other, and each pass hits exactly what a one-salt run hits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tpcache.cache.errors import InvalidNamespace
from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE as TRACE
from tpcache.trace import load_trace


@pytest.mark.parametrize("swa_window", [None, 512])
def test_two_salts_share_nothing_and_each_hits_as_one_run(swa_window: int | None) -> None:
    requests = load_trace(TRACE, 150)
    plain = replay(requests, ReplayOptions(None, 16, swa_window=swa_window))
    salted = replay(requests, ReplayOptions(None, 16, swa_window=swa_window, salts=("a", "b")))
    assert plain["matched_tokens"] > 0
    for one in salted["passes"]:
        # Equal figures: a cross hit would make the second pass hit (nearly) everything.
        assert (one["prompt_tokens"], one["matched_tokens"]) == (
            plain["prompt_tokens"],
            plain["matched_tokens"],
        )
    assert salted["matched_tokens"] == 2 * plain["matched_tokens"]
    # One salt, or a LoRA id: the same hits as the default namespace.
    for opts in (ReplayOptions(None, 16, salts=("a",)), ReplayOptions(None, 16, lora_id=7)):
        assert replay(requests, opts)["matched_tokens"] == plain["matched_tokens"]


def test_a_bad_salt_or_lora_id_is_refused() -> None:
    with pytest.raises(InvalidNamespace, match="salt must have 1 to 256 characters, got 0"):
        ReplayOptions(None, 16, salts=("",))
    with pytest.raises(InvalidNamespace, match=r"lora_id must be in \[0, 2\*\*63\), got -2"):
        ReplayOptions(None, 16, lora_id=-2)


def test_cli_replay_with_two_salts_prints_each_pass() -> None:
    cmd = [sys.executable, "-m", "tpcache", "replay", "--limit", "40", "--salt", "x"]
    out = subprocess.run([*cmd, "--salt", "y"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("salt ")]
    assert len(lines) == 2 and lines[0].split("hit rate")[1] == lines[1].split("hit rate")[1]
    # With a host tier too: each salt's pass hits only its own, on either tier, and a
    # host that holds what the small device pool cannot gives each pass what an infinite
    # cache does.
    small = ["--limit", "200", "--scale", "1/16", "--salt", "x", "--salt", "y", "--json"]
    runs = [
        subprocess.run(
            [sys.executable, "-m", "tpcache", "replay", *small, *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for extra in ([], ["--capacity", "8000", "--host-capacity", "400000"])
    ]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    inf, host = (json.loads(r.stdout) for r in runs)
    want = [p["matched_tokens"] for p in inf["passes"]]
    assert [p["matched_tokens"] for p in host["passes"]] == want and want[0] == want[1] > 0
    assert host["host_hit_tokens"] > 0
