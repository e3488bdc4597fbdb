"""``--timeout`` bounds the coordinator's wait for a step, not only a collective: the CLI
derives ``CoordinatorConfig.step_timeout_s`` from it (``step_timeout_for``), so a rank
hung where no peer can notice (TP=1) is found in seconds, not after the 120 s default.
Bad values are refused before anything starts."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

import pytest
from drill_worker import DrillWorker

from tpcache.cli import build_parser
from tpcache.cli.args import group_config
from tpcache.coordinator.errors import CoordinatorConfigError
from tpcache.coordinator.step_types import CoordinatorConfig, step_timeout_for
from tpcache.errors import TpcacheError


@pytest.mark.parametrize("cmd", ["demo", "serve"])
@pytest.mark.parametrize(
    ("timeout", "step"),
    [("60", 120.0), ("2", 7.0), ("0.5", 5.5), ("5", 10.0), ("7.5", 15.0), ("300", 600.0)],
)
def test_the_parsed_timeout_sets_the_step_timeout(cmd: str, timeout: str, step: float) -> None:
    args = build_parser().parse_args([cmd, "--timeout", timeout])
    cfg = group_config(args, 1024)
    assert cfg.timeout_s == float(timeout)
    assert cfg.coordinator.step_timeout_s == step
    # Nothing else of the coordinator's config changes.
    assert cfg.coordinator == dataclasses.replace(CoordinatorConfig(), step_timeout_s=step)


def test_the_default_timeout_keeps_the_default_step_timeout() -> None:
    for cmd in ("demo", "serve"):
        cfg = group_config(build_parser().parse_args([cmd]), 1024)
        assert (cfg.timeout_s, cfg.coordinator.step_timeout_s) == (60.0, 120.0)
    assert CoordinatorConfig().step_timeout_s == step_timeout_for(60.0) == 120.0


def test_the_step_timeout_leaves_a_collective_room_to_fail_first() -> None:
    for t in (0.001, 0.5, 1.0, 4.0, 5.0, 5.001, 20.0, 3600.0, 4.9e8):
        step = step_timeout_for(t)
        assert step >= 2 * t and step >= t + 5.0
        assert step == max(2 * t, t + 5.0)


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "60", None]
)
def test_bad_collective_timeouts_are_a_typed_error(bad) -> None:
    with pytest.raises(CoordinatorConfigError, match=r"^timeout_s=.* must be a finite number"):
        step_timeout_for(bad)
    with pytest.raises(CoordinatorConfigError, match=r"^--timeout=.* must be a finite number"):
        step_timeout_for(bad, "--timeout")


def test_a_timeout_too_long_for_a_step_timeout_is_a_typed_error() -> None:
    with pytest.raises(CoordinatorConfigError) as caught:
        step_timeout_for(5e8)
    assert str(caught.value) == (
        "timeout_s=500000000.0 is too long: the coordinator would wait 1e+09 s for a step, "
        "and waits are limited to under 1e+09 s"
    )
    assert isinstance(caught.value, TpcacheError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, math.nan, math.inf, -math.inf, 1e9, 2e9, True, "120", None]
)
def test_bad_step_timeouts_are_a_typed_error(bad) -> None:
    with pytest.raises(CoordinatorConfigError, match=r"^coordinator config: step_timeout_s "):
        CoordinatorConfig(step_timeout_s=bad)
    with pytest.raises(CoordinatorConfigError, match=r"^coordinator config: step_timeout_s "):
        dataclasses.replace(CoordinatorConfig(), step_timeout_s=bad)


@pytest.mark.parametrize("cmd", ["demo", "serve"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "-inf", "soon", ""])
def test_bad_timeouts_are_refused_by_argparse(cmd: str, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args([cmd, "--timeout", bad])
    assert caught.value.code == 2
    assert "argument --timeout: expected " in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["demo", "serve"])
def test_a_timeout_too_long_is_an_argparse_error_before_anything_starts(cmd: str) -> None:
    """Through the real command: exit 2 with one line, before it joins a cluster. The
    address answers nothing, so a command that went on would fail there (exit 2, another
    message) and never start a cluster of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    got = subprocess.run(
        [sys.executable, "-m", "tpcache", cmd, "--timeout", "6e8", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().splitlines()[-1] == (
        f"tpcache {cmd}: error: --timeout=600000000.0 is too long: the coordinator would wait "
        "1.2e+09 s for a step, and waits are limited to under 1e+09 s"
    )
    assert "Traceback" not in got.stderr and got.stdout == ""


def test_a_hung_rank_at_tp1_is_found_within_the_step_timeout(ray_cluster) -> None:
    """TP=1: no peer's collective or answer can show the rank hung; only the coordinator's
    own wait does, and that is --timeout's now (2 s: 7 s), not the default 120 s."""
    from tpcache.frontend.service import start_group
    from tpcache.workers.protocol import RankFailure

    args = build_parser().parse_args(
        ["demo", "--tp", "1", "--timeout", "2", "--page-size", "4", "--capacity", "1024"]
    )
    cfg = group_config(args, args.capacity)
    assert cfg.coordinator.step_timeout_s == 7.0
    # No recovery: the replacement rank's start-up is not what is timed here.
    cfg = dataclasses.replace(
        cfg, coordinator=dataclasses.replace(cfg.coordinator, auto_recover=False)
    )
    coord = start_group(cfg, worker_cls=DrillWorker)
    try:
        coord.admit("a", list(range(1, 30)))
        coord.sync()
        step = coord.stats()["steps_sent"]
        coord.ranks.call_on(0, "inject_fault", step, "sleep", 60.0)
        t = time.monotonic()
        with pytest.raises(RankFailure) as caught:
            coord.finish("a")
            coord.sync()
        took = time.monotonic() - t
        print(f"hung rank at TP=1 found in {took:.2f}s (step timeout 7s)")
        assert caught.value.step == step
        assert str(caught.value) == (
            f"step {step}: rank 0 failed: ChannelError: rank 0: did not answer message "
            f"{step + 1} in time"
        )
        assert 7.0 <= took < 10.0
    finally:
        coord.close()
