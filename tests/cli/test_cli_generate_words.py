"""What ``tpcache generate`` prints at its end is figures a user reads: the end-to-end
time with the cache as a fraction of the time without it, and the hit rate it came from,
with no pass/fail word about a target (it used to end with a verdict on the time ratio). Run as a real process on a small slice."""

from __future__ import annotations

import json
import re
import subprocess
import sys

SLICE = ["--limit", "6", "--clients", "2", "--layers", "2", "--hidden", "64", "--ffn", "128"]


def generate(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpcache", "generate", *SLICE, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_time_line_gives_the_ratio_and_the_hit_rate() -> None:
    got = generate()
    assert got.returncode == 0, got.stderr
    time_lines = [ln for ln in got.stdout.splitlines() if ln.strip().startswith("time ")]
    assert len(time_lines) == 1, got.stdout
    m = re.fullmatch(
        r"  time {12}with the cache (\d\.\d{3}) of the time without it, at a hit rate of "
        r"(\d\.\d{3})",
        time_lines[0],
    )
    assert m, time_lines[0]
    for word in ("bar", "met", "target", "within", "above"):
        assert word not in got.stdout.lower().split(), (word, got.stdout)
    # The figures are the run's own: the same slice again, as JSON.
    again = json.loads(generate("--json").stdout)
    hit = again["cache"]["hit_rate"]
    assert 0.0 <= hit < 1.0 and float(m.group(2)) == round(hit, 3)
