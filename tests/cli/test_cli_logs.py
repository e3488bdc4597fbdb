"""``--log-level`` and ``--worker-logs`` as an operator meets them: a level that is not
one of the four is a one-line error; the level changes what is printed on stderr; the
lines of a served coordinator (in its Ray actor) reach ``tpcache serve``'s stderr,
through its relay, or through Ray's forwarding with ``--worker-logs``. Commands run as
real processes."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import TPCACHE, clean_env, end

# tpcache's line format: a timestamp, the level, the logger, the message.
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) tpcache\.")
TINY = ["--limit", "2", "--tp", "2", "--hidden", "32", "--heads", "2", "--ffn", "64"]
TINY += ["--layers", "1", "--clients", "1", "--scale", "1/512"]


@pytest.fixture
def nowhere() -> Iterator[str]:
    """A Ray address where nothing listens (a port bound, not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TPCACHE, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["demo", "generate", "serve"])
@pytest.mark.parametrize("level", ["LOUD", "", "5"])
def test_a_bad_level_is_one_line(command: str, level: str, nowhere: str) -> None:
    extra = [] if command == "generate" else ["--address", nowhere]
    got = run(command, "--log-level", level, *extra)
    assert got.returncode == 2, got.stderr
    assert got.stderr == (
        f"tpcache {command}: --log-level: the log level must be one of DEBUG, INFO, "
        f"WARNING, ERROR, got {level!r}\n"
    )


def test_the_level_changes_what_is_printed() -> None:
    debug = run("generate", *TINY, "--log-level", "debug")
    assert debug.returncode == 0, debug.stderr
    ours = [line for line in debug.stderr.splitlines() if LINE.match(line)]
    assert ours and all(" DEBUG tpcache.coordinator: " in line for line in ours), debug.stderr
    assert ours[0].endswith(" DEBUG tpcache.coordinator: 2 ranks started as threads of this process")  # fmt: skip
    for level in ("WARNING", "INFO"):  # INFO (the default) and up: nothing in a healthy run
        quiet = run("generate", *TINY, "--log-level", level)
        assert quiet.returncode == 0, quiet.stderr
        assert not [line for line in quiet.stderr.splitlines() if LINE.match(line)]
        assert quiet.stdout.splitlines()[0] == debug.stdout.splitlines()[0]


def serve_until_up(root: Path, *options: str) -> str:
    """``tpcache serve`` (TP=2, a fresh local cluster) with ``options``, stopped by SIGTERM
    once it serves; its stdout and stderr together."""
    env = clean_env(root)
    env["RAY_TMPDIR"] = str(root / "ray")  # short: Unix socket paths
    out = root / "serve.out"
    cmd = [*TPCACHE, "serve", "--tp", "2", "--capacity", "4096", "--page-size", "4"]
    cmd += ["--name", "logs", "--namespace", "cli-logs", *options]
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C or SIGTERM here" not in (text := out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        time.sleep(1.0)  # a forwarded line may trail the summary
        proc.terminate()
        assert proc.wait(60) == 0, out.read_text()[-3000:]
        return out.read_text()
    finally:
        end([proc], str(root))
        shutil.rmtree(root, ignore_errors=True)


def test_serve_prints_its_actors_lines_at_the_level_asked() -> None:
    root = Path(tempfile.mkdtemp(prefix="tplog", dir="/tmp"))
    text = serve_until_up(root, "--log-level", "DEBUG").splitlines()
    # Relayed from the coordinator's actor, as it wrote them, before the summary.
    started = [i for i, line in enumerate(text) if " DEBUG tpcache.coordinator: rank " in line]
    assert len(started) == 2, text
    assert LINE.match(text[started[0]]) and " rank 0 started: actor " in text[started[0]]
    serving = next(i for i, line in enumerate(text) if line.startswith("tpcache serving"))
    assert started[1] < serving


@pytest.mark.slow  # a second cluster's start (~30 s here); the relay above is the default
def test_worker_logs_come_through_ray_instead() -> None:
    root = Path(tempfile.mkdtemp(prefix="tplog", dir="/tmp"))
    text = serve_until_up(root, "--log-level", "DEBUG", "--worker-logs")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()  # Ray colours its marks
    started = [line for line in plain if " DEBUG tpcache.coordinator: rank " in line]
    # Once each, marked by Ray with the worker they came from: not relayed as well.
    assert len(started) == 2, text
    assert all(line.startswith("(CoordinatorService pid=") for line in started), started
