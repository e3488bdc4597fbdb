"""``tpcache generate`` derives the coordinator's step timeout from its ``--timeout`` as
``demo`` and ``serve`` do (``step_timeout_for``; ``test_step_timeout.py``), instead of
the fixed 120 s default; a timeout that cannot give one is refused before anything
starts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpcache.cli import main
from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.step_types import CoordinatorConfig
from tpcache.harness.gen_wire import GenerateError
from tpcache.harness.generate import GenerateOptions, GenRequest, ModelSize, group_config

TINY = ModelSize(hidden=32, heads=4, ffn=64, layers=1)
TIMEOUTS = [("120", 240.0), ("60", 120.0), ("2", 7.0), ("0.5", 5.5), ("5", 10.0), ("300", 600.0)]


class _Started(Exception):
    """Raised where the group would start: the run has gone as far as it should."""


def _no_group(monkeypatch) -> list[GroupConfig]:
    """The configs the command asks to start a group with; the start itself raises."""
    seen: list[GroupConfig] = []

    def start(config: GroupConfig, *args, **kwargs):
        seen.append(config)
        raise _Started

    monkeypatch.setattr("tpcache.coordinator.local_ranks.start_local_group", start)
    return seen


@pytest.mark.parametrize(("timeout", "step"), TIMEOUTS)
def test_the_parsed_timeout_sets_the_step_timeout(timeout: str, step: float, monkeypatch) -> None:
    """Through the real command, up to the group's start: the config it starts with."""
    seen = _no_group(monkeypatch)
    with pytest.raises(_Started):
        main(["generate", "--limit", "2", "--timeout", timeout])
    (cfg,) = seen
    assert cfg.timeout_s == float(timeout)
    # Nothing else of the coordinator's config changes.
    assert cfg.coordinator == CoordinatorConfig(auto_recover=False, step_timeout_s=step)


@pytest.mark.parametrize(("timeout", "step"), TIMEOUTS)
def test_the_options_timeout_sets_the_step_timeout(timeout: str, step: float) -> None:
    opts = GenerateOptions(model=TINY, timeout_s=float(timeout))
    assert opts.step_timeout_s == step
    cfg = group_config(opts, [GenRequest(0, np.arange(1, 9), 2)])
    assert cfg.timeout_s == float(timeout)
    assert cfg.coordinator == CoordinatorConfig(auto_recover=False, step_timeout_s=step)


def test_the_default_timeout_gives_twice_its_step_timeout() -> None:
    assert GenerateOptions(model=TINY).step_timeout_s == 240.0


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "60", None]
)
def test_bad_timeouts_are_generate_errors(bad) -> None:
    with pytest.raises(GenerateError) as caught:
        GenerateOptions(model=TINY, timeout_s=bad)
    assert str(caught.value) == f"timeout_s={bad!r} must be a finite number of seconds > 0"


def test_a_timeout_too_long_for_a_step_timeout_is_a_generate_error() -> None:
    with pytest.raises(GenerateError) as caught:
        GenerateOptions(model=TINY, timeout_s=5e8)
    assert str(caught.value) == (
        "timeout_s=500000000.0 is too long: the coordinator would wait 1e+09 s for a step, "
        "and waits are limited to under 1e+09 s"
    )


def test_a_timeout_too_long_is_refused_before_anything_starts(monkeypatch, capsys) -> None:
    seen = _no_group(monkeypatch)
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--limit", "2", "--timeout", "6e8"])
    assert caught.value.code == 2 and seen == []
    out = capsys.readouterr()
    assert out.err.strip().splitlines()[-1] == (
        "tpcache generate: error: timeout_s=600000000.0 is too long: the coordinator would "
        "wait 1.2e+09 s for a step, and waits are limited to under 1e+09 s"
    )
    assert out.out == ""


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "-inf", "soon", ""])
def test_bad_timeouts_are_refused_by_argparse(bad: str, monkeypatch, capsys) -> None:
    seen = _no_group(monkeypatch)
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--timeout", bad])
    assert caught.value.code == 2 and seen == []
    assert "argument --timeout: expected " in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["2147484", "3e6", "4.9e8"])
def test_a_timeout_past_zmqs_poll_is_refused_before_anything_starts(
    timeout: str, monkeypatch, capsys
) -> None:
    """The clients poll ZMQ with the timeout in milliseconds, a C int: past 2,147,483 s
    each client's poll raised OverflowError in its thread and the run hung, silent (a red
    team's `--timeout 2147484`)."""
    seen = _no_group(monkeypatch)
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--limit", "2", "--timeout", timeout])
    assert caught.value.code == 2 and seen == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tpcache generate: error: timeout_s must be at most 2,147,483 s (ZMQ's poll), "
        f"got {float(timeout)!r}"
    )


def test_the_longest_timeout_zmq_takes_is_accepted() -> None:
    assert GenerateOptions(model=TINY, timeout_s=2_147_483).step_timeout_s == 4_294_966.0
