"""``torchrun ... -m tpcache.torchrun check`` refuses a job it cannot run in one line,
said once (by rank 0), before any rank joins the group: a world size that does not
divide the checked model, ``--drills`` without a worker that has fault drills, a
``--worker`` that does not load. Before, each was a traceback on every rank (an
AttributeError from the drill's first call; a PoolConfigError per rank).

What torchrun's launcher prints after a rank fails (its own ChildFailedError report)
is the launcher's, not ours: these tests check that no rank printed a traceback and
that our line came once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpcache.torchrun import main

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
PREFIX = "tpcache.torchrun check: "


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    assert TORCHRUN, "torchrun is not installed next to this Python"
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "tpcache.torchrun"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, "check", *args], capture_output=True, text=True, timeout=120, env=env
    )


def said_once(got: subprocess.CompletedProcess) -> str:
    """Our one line, after checking the job failed, said it once and no rank traced."""
    assert got.returncode != 0
    ours = [ln for ln in got.stderr.splitlines() if ln.startswith(PREFIX)]
    assert len(ours) == 1, got.stderr
    assert "[rank" not in got.stderr and "tpcache/torchrun.py" not in got.stderr, got.stderr
    return ours[0]


def test_a_world_that_does_not_divide_the_model_is_said_once() -> None:
    t0 = time.monotonic()
    line = said_once(torchrun(3))
    assert line == (
        PREFIX + "3 ranks (torchrun's --nproc_per_node) cannot split the checked model: its "
        "4 KV heads and MLP of 64 divide over 1, 2, 4 ranks only; run one of those"
    )
    assert time.monotonic() - t0 < 60  # nobody waited for a group


def test_drills_without_a_drill_worker_are_said_once() -> None:
    line = said_once(torchrun(2, "--drills"))
    assert "--drills plants faults through the worker's plant_slot_error, inject_fault" in line
    assert "--worker tpcache.workers.rank:RankWorker does not have" in line
    assert "--worker drill_worker:DrillWorker" in line


@pytest.fixture
def rank_env(monkeypatch):
    """torchrun's variables for rank ``rank`` of ``world`` (no group is formed: every
    refusal comes before the join)."""

    def set_rank(rank: int, world: int) -> None:
        for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
            monkeypatch.setenv(name, str(value))
        monkeypatch.setenv("MASTER_PORT", "1")

    return set_rank


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--worker", "no_such_module:W"], "--worker no_such_module:W: ModuleNotFoundError"),
        (["--worker", "tpcache.errors:TpcacheError"], "not a RankWorker subclass"),
        (["--drills"], "does not have: give a worker class with fault drills"),
    ],
)
def test_only_rank_0_says_it(rank_env, capsys, args: list[str], said: str) -> None:
    rank_env(0, 2)
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and said in err and err.count("\n") == 1
    rank_env(1, 2)
    assert main(["check", *args]) == 2
    assert capsys.readouterr().err == ""


def test_the_drill_worker_passes_the_check() -> None:
    """A worker with the drills, on a world the model divides over, is let through."""
    from tpcache.harness.torchrun_check import RunConfig
    from tpcache.model.reference import ModelSpec
    from tpcache.torchrun import job_problem, parse
    from tpcache.workers.spec import CacheSpec

    args = parse(["check", "--drills", "--worker", "drill_worker:DrillWorker"])
    cfg = RunConfig(ModelSpec(heads=4, ffn=64), CacheSpec(page_size=4), 192, "float32", 120.0)
    assert job_problem(args, cfg, 2) is None and job_problem(args, cfg, 4) is None
    assert "cannot split the checked model" in (job_problem(args, cfg, 8) or "")
