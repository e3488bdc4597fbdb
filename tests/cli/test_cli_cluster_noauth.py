"""The CLI against a Ray head without token authentication, from a HOME that holds a
token (a red team's find): a head that takes no token lets a driver that sends one
join, but such a driver refuses the cluster's calls back to it and every actor it makes
is cancelled. ``tpcache`` must ask without a token first and leave tokens off.

The head is ``RAY_AUTH_MODE=disabled ray start --head`` under a HOME of its own with no
token; the driver's HOME holds one (``ray get-auth-token --generate``); the tpcache
command runs without ``RAY_AUTH_MODE``, as a user's would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster_helpers import RAY, clean_env, end, free_port, ray_start, run_tpcache

# The actors the cluster knows, asked by a driver that sets the mode itself (Ray's own
# workaround), so the answer does not depend on the code under test.
ACTORS = r"""
import json, sys
import ray

ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps(sorted((a["ActorClassName"], a["State"]) for a in ray._private.state.actors().values())))
"""


def _processes_under(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose environment names ``marker``: the
    head's processes and the workers they start inherit its HOME."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def test_demo_joins_a_head_without_tokens_from_a_home_with_a_token() -> None:
    root = Path(tempfile.mkdtemp(prefix="tpna", dir="/tmp"))  # short: sockets
    head_home, driver_home = root / "head", root / "driver"
    head_home.mkdir()
    driver_home.mkdir()
    address = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    try:
        driver = clean_env(driver_home)
        get = [RAY, "get-auth-token", "--generate"]
        subprocess.run(get, env=driver, check=True, capture_output=True, timeout=60)
        assert (driver_home / ".ray" / "auth_token").stat().st_size > 0
        head = {**clean_env(head_home), "RAY_AUTH_MODE": "disabled"}
        args = f"--head --port {address.rpartition(':')[2]} --include-dashboard false"
        ray_start(root, "head", args, head, procs)
        assert not (head_home / ".ray" / "auth_token").exists()
        before = _processes_under(str(head_home))

        got = run_tpcache(
            f"demo --address {address} --tp 2 --capacity 4096 --page-size 4 --limit 16".split(),
            driver,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr[-3000:]
        assert "Traceback" not in got.stderr
        assert got.stdout.splitlines()[-1] == "lockstep verified: 2 steps, 0 divergences"

        asked = subprocess.run(
            [sys.executable, "-c", ACTORS, address],
            env={**driver, "RAY_AUTH_MODE": "disabled"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode == 0, asked.stderr[-3000:]
        assert json.loads(asked.stdout) == [["RankWorker", "DEAD"], ["RankWorker", "DEAD"]]

        # the ranks' worker processes end shortly after their actors
        deadline = time.monotonic() + 15
        while (left := _processes_under(str(head_home))) != before:
            if time.monotonic() > deadline:
                extra = {p: c for p, c in left.items() if p not in before}
                raise AssertionError(f"left behind: {extra}")
            time.sleep(0.5)
        assert _processes_under(str(driver_home)) == {}
    finally:
        end(procs, str(root))
        shutil.rmtree(root, ignore_errors=True)
