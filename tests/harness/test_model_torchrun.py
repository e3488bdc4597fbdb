"""torchrun mode: two ranks under ``torchrun`` (gloo), rank 0 the coordinator.

Runs ``torchrun --standalone --nproc_per_node=2 -m tpcache.torchrun check`` as a
subprocess and checks its verdict: cached logits equal full recompute (whole, chunked,
under eviction pressure), rank digests equal the mirror's, a wrong slot on one rank
shows in the logits, and a planted divergence stops both ranks at its step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpcache.torchrun import parse

HERE = Path(__file__).resolve().parents[1] / "support"  # the test worker
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)


def run_check(nproc: int, *args: str, timeout: float = 240.0) -> dict:
    assert TORCHRUN, "torchrun is not installed next to this Python"
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "tpcache.torchrun"]
    # The fault drills live in the tests' worker class (drill_worker.py, found on the path).
    drills = ["--worker", "drill_worker:DrillWorker", "--drills"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [*cmd, "check", *drills, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"tpcache_check"')]
    assert lines, f"no verdict (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    verdict = json.loads(lines[-1])["tpcache_check"]
    print(json.dumps({k: v for k, v in verdict.items() if not isinstance(v, dict)}))
    assert out.returncode == (0 if verdict["ok"] else 1)
    return verdict


def test_torchrun_two_ranks_match_full_recompute():
    seed = 11
    print(f"seed={seed}")
    got = run_check(2, "--seed", str(seed), "--timeout-s", "45", "--join-timeout-s", "90")
    assert got["world_size"] == 2 and got["backend"] == "gloo"
    assert (got["timeout_s"], got["join_timeout_s"]) == (45.0, 90.0)
    for name in ("basic", "chunked", "evict"):
        rep = got[name]
        assert rep["ok"] and rep["max_rel_err"] <= 1e-5, (name, rep)
        assert rep["greedy_mismatches"] == 0 and rep["greedy_checked"] > 0
        assert rep["computed_tokens"] == (
            rep["prompt_tokens"] + rep["decode_tokens"] - rep["hit_tokens"]
        )
    assert got["basic"]["hit_tokens"] > 0
    assert got["evict"]["evicted_pages"] > 0
    assert got["digests_equal"]
    assert got["tokens_computed"][0] == got["tokens_computed"][1] > 0
    assert got["planted_slot_detected"], got["planted_slot"]
    assert got["divergence_caught"], got.get("divergence")
    assert got["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchrun_gpu_bf16_nccl():
    nproc = min(2, torch.cuda.device_count())
    got = run_check(nproc, "--seed", "12", "--dtype", "bfloat16", "--tol", "1e-2")
    assert got["backend"] == ("nccl" if nproc > 1 else got["backend"])
    assert got["ok"], got


@pytest.mark.parametrize("option", ["--timeout-s", "--join-timeout-s"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_torchrun_refuses_bad_timeouts_before_starting(option: str, bad: str, capsys) -> None:
    # Parsed before any rank joins a group: a typo must not become a 30-minute wait.
    with pytest.raises(SystemExit) as exc:
        parse(["check", option, bad])
    assert exc.value.code == 2
    assert "seconds" in capsys.readouterr().err
    assert parse(["check", option, "2.5"]).__dict__[option[2:].replace("-", "_")] == 2.5
