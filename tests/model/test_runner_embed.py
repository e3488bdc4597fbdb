"""tpcache embedded in a torchrun job that initialised ``torch.distributed`` itself: the
rank side runs on the TP group the job hands it (``tests/support/embed_job.py``, 2 processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)
JOB = Path(__file__).resolve().parents[1] / "support" / "embed_job.py"


def test_tpcache_runs_on_the_tp_group_of_a_job_that_owns_torch_distributed():
    seed = 8400
    print(f"seed={seed}")
    assert TORCHRUN, "torchrun is not installed next to this Python"
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(JOB), str(seed)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith('{"tpcache_embed"')]
    assert lines, f"no verdict (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    got = json.loads(lines[-1])["tpcache_embed"]
    print(json.dumps({k: v for k, v in got.items() if k != "report"}))
    assert run.returncode == 0
    assert got["join_refused"]  # TPGroup.init refuses: the process already has a group
    assert got["capacity"] == 160  # MIN of the ranks' 160 and 192
    rep = got["report"]
    assert got["ok"] and rep["max_rel_err"] <= 1e-5 and rep["greedy_mismatches"] == 0
    assert rep["hit_tokens"] > 0 and rep["forwards"] < rep["items"]
    assert got["digests_equal"] and got["backends"] == ["gloo", "gloo"]
    assert got["tokens_computed"] == [rep["computed_tokens"]] * 2
    # the job's world and its TP group outlive tpcache's shutdown
    assert got["job_sum_before"] == got["job_sum_after"] == got["tp_group_sum_after"] == 3.0
