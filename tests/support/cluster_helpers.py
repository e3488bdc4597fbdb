"""Ray nodes started by ``ray start`` and tpcache commands run as a user's would, for the
tests against real clusters (tests/cli/test_cli_cluster.py, tests/cli/test_cli_cluster_noauth.py).

Every node is one ``--block`` process group under a HOME and a temp dir of its own (its
``~/.ray``), so the user's ``~/.ray`` is never read or written; ``end`` ends them by
process group, then anything left that names the temp dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
TPCACHE = [sys.executable, "-m", "tpcache"]
RAY_INFO = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+INFO ")  # Ray's log lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment without Ray's address or auth settings, under ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.pop("RAY_TMPDIR", None)
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return env


def end(procs: list[subprocess.Popen], marker: str) -> None:
    """End ``procs`` (each the leader of its process group), then any process left whose
    command line names ``marker`` (a temp dir of ours)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = path.read_text() if path.exists() else ""
        if text in got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {path} (exit {proc.poll()}): {got[-3000:]}")


def ray_start(
    root: Path, name: str, args: str, env: dict[str, str], started: list[subprocess.Popen]
) -> None:
    """``ray start ARGS`` under ``env`` as one process group (``--block``), its temp dir
    under ``root``; returns once Ray says it started. Log: ``root/NAME.log``. The process
    goes on ``started`` before the wait, so a node that never starts is ended too."""
    log = root / f"{name}.log"
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    ours = f"--temp-dir {root / 'ray'} --num-cpus 1 --block"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [RAY, "start", *f"{args} {ours}".split()],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started.append(proc)
    wait_for(log, "Ray runtime started", proc, 120)


def run_tpcache(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """``tpcache ARGS`` to the end; ``.seconds`` it took."""
    t0 = time.monotonic()
    got = subprocess.run(
        [*TPCACHE, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    got.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    print(f"tpcache {' '.join(args)}: exit {got.returncode} in {got.seconds:.1f} s")  # type: ignore[attr-defined]
    return got


def said_lines(text: str) -> list[str]:
    """stderr without Ray's own log lines (a driver that joined logs 'Connecting...')."""
    return [ln for ln in text.splitlines() if ln.strip() and not RAY_INFO.match(ln)]
