"""The CLI against a Ray cluster of two nodes started as the README says, every command
a real process.

``ray get-auth-token --generate``, ``RAY_AUTH_MODE=token ray start --head --port P`` and
``RAY_AUTH_MODE=token ray start --address 127.0.0.1:P`` (the second node), each node one
``--block`` process group with a temp dir of its own, under a HOME of its own (its
``~/.ray/auth_token``); the tpcache commands run without ``RAY_AUTH_MODE``, as a user's
would. Everything started is ended by process group, then by its temp dir.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cluster_helpers import (
    RAY,
    TPCACHE,
    clean_env,
    end,
    free_port,
    ray_start,
    run_tpcache,
    said_lines,
    wait_for,
)

GROUP = "--tp 2 --capacity 4096 --page-size 4"

# A frontend joining by the printed address (tests/cli/test_cli_client.py has every call).
FRONTEND = r"""
import json, sys
import tpcache

c = tpcache.connect(sys.argv[1], "cli", address=sys.argv[2])
prompt = list(range(1, 41))
first = c.admit("a", prompt)
c.finish("a", [7, 8])
with c.batch() as b:
    again = b.admit("b", prompt + [9])
    b.finish("b")
print(json.dumps({"client": type(c).__name__, "paths": c.stats()["rank_paths"],
                  "prefix": [first.prefix_len, again.result().prefix_len]}))
"""


class TwoNodes:
    """The README's multi-node steps on one machine: a head (custom resource node_a) and
    a second node (node_b), both under token authentication."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tpcli", dir="/tmp"))  # short: sockets
        self.home = self.root / "home"
        self.home.mkdir()
        self.env = clean_env(self.home)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def _node(self, name: str, args: str) -> None:
        """``RAY_AUTH_MODE=token ray start ARGS``."""
        ray_start(self.root, name, args, {**self.env, "RAY_AUTH_MODE": "token"}, self.procs)

    def start(self) -> None:
        get = [RAY, "get-auth-token", "--generate"]
        subprocess.run(get, env=self.env, check=True, capture_output=True, timeout=60)
        assert (self.home / ".ray" / "auth_token").stat().st_size > 0
        only_here = '--include-dashboard false --resources {"node_a":2}'
        self._node("head", f"--head --port {self.port} {only_here}")
        self._node("node_b", f'--address {self.address} --resources {{"node_b":2}}')

    def stop(self) -> None:
        end(self.procs, str(self.root))
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, line: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return run_tpcache(line.split(), env or self.env)


def _frontend(name: str, address: str, env: dict) -> dict:
    got = subprocess.run(
        [sys.executable, "-c", FRONTEND, name, address], env=env, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout)


def _serve_in_background(args: list[str], env: dict, root: Path) -> subprocess.Popen:
    """``tpcache serve ARGS`` in a process group of its own; stdout and stderr to
    ``root/serve.out`` and ``root/serve.err``."""
    with open(root / "serve.out", "w") as so, open(root / "serve.err", "w") as se:
        return subprocess.Popen(
            [*TPCACHE, "serve", *args], env=env, stdout=so, stderr=se, start_new_session=True
        )


@pytest.fixture(scope="module")
def nodes():
    t0 = time.monotonic()
    cluster = TwoNodes()
    try:
        cluster.start()
        print(f"two nodes up in {time.monotonic() - t0:.1f} s")
        yield cluster
    finally:
        cluster.stop()


def test_the_readme_multinode_steps_are_the_ones_tested_here() -> None:
    """TwoNodes runs these, on one machine (a port, temp dir, resources of its own)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("### Across nodes:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    assert [ln for ln in block.splitlines() if ln and not ln.startswith("#")] == [
        ".venv/bin/ray get-auth-token --generate",
        "RAY_AUTH_MODE=token .venv/bin/ray start --head --port 6379",
        "RAY_AUTH_MODE=token .venv/bin/ray start --address HEAD_IP:6379",
        ".venv/bin/tpcache serve --address HEAD_IP:6379 --tp 4 --strategy SPREAD --detached",
    ]


def test_demo_across_two_nodes_by_explicit_address_under_tokens(nodes) -> None:
    rank_per_node = "--strategy SPREAD --rank-resources node_a=1;node_b=1"
    got = nodes.run(f"demo --address {nodes.address} --tp 2 {rank_per_node} --limit 48")
    assert got.returncode == 0, got.stderr[-3000:]
    lines = got.stdout.splitlines()
    assert lines[-1] == "lockstep verified: 6 steps, 0 divergences"
    # one rank on each node: the coordinator's node over IPC, the other over CURVE TCP
    reached = next(ln for ln in lines if ln.startswith("  ranks reached "))
    assert sorted(reached.split(None, 2)[2].split(", ")) == ["ipc", "tcp+curve"]
    # the two latencies, named for what they measure
    submit = next(ln for ln in lines if ln.startswith("  step submit "))
    latency = next(ln for ln in lines if ln.startswith("  step latency "))
    assert submit.endswith("ms median: the calls of one step, as the frontend waits for them")
    assert latency.endswith(
        "ms median, from a step's close to every rank's verified result: includes queueing "
        "behind the steps submitted before it"
    )
    assert "per-step latency" not in got.stdout


def test_a_missing_or_wrong_token_fails_fast_in_one_line(nodes) -> None:
    empty = nodes.root / "empty-home"
    empty.mkdir(exist_ok=True)
    got = nodes.run(f"demo --address {nodes.address} --limit 8", env=clean_env(empty))
    assert got.returncode == 2
    assert said_lines(got.stderr) == [
        f"tpcache demo: the Ray cluster at {nodes.address} uses token authentication and "
        "there is no token here: copy the head node's ~/.ray/auth_token to ~/.ray/auth_token "
        "on this machine (or set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
    ]
    wrong = {**clean_env(empty), "RAY_AUTH_TOKEN": "0" * 32}
    got = nodes.run(f"stop --address {nodes.address}", env=wrong)
    assert got.returncode == 2
    assert said_lines(got.stderr) == [
        f"tpcache stop: the Ray cluster at {nodes.address} refused the token in RAY_AUTH_TOKEN: "
        "copy the head node's ~/.ray/auth_token to ~/.ray/auth_token on this machine (or set "
        "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
    ]
    assert got.seconds < 15  # type: ignore[attr-defined]  # Ray alone retried ~20 s


@pytest.mark.parametrize(
    "setting, why",
    [
        ({"RAY_AUTH_TOKEN_PATH": "/nonexistent/token"}, "RAY_AUTH_TOKEN_PATH names "
         "/nonexistent/token, which cannot be read or is empty"),
        ({"RAY_AUTH_TOKEN": "   "}, "RAY_AUTH_TOKEN is set but blank"),
    ],
)  # fmt: skip
def test_a_token_setting_ray_cannot_use_is_one_line(nodes, setting, why) -> None:
    """With the right token in ~/.ray/auth_token, a RAY_AUTH_TOKEN_PATH that names no file
    or a blank RAY_AUTH_TOKEN made Ray end the process at a failed check: exit 1 with
    nothing printed (a red team's find). Ray reads neither further, so neither does
    tpcache: it says which setting is wrong, with the mode unset or token."""
    for mode in ({}, {"RAY_AUTH_MODE": "token"}):
        got = nodes.run(f"stop --address {nodes.address}", env={**nodes.env, **setting, **mode})
        assert got.returncode == 2, got.stderr
        head = "RAY_AUTH_MODE=token here, but" if mode else (
            f"the Ray cluster at {nodes.address} uses token authentication, but"
        )  # fmt: skip
        assert said_lines(got.stderr) == [f"tpcache stop: {head} {why}"]


def test_serve_detached_a_frontend_a_taken_name_replace_and_sigterm(nodes) -> None:
    a = nodes.address
    name = "--name cli-t --namespace cli"
    placed = "--transport ray --strategy STRICT_SPREAD"
    got = nodes.run(f"serve --address {a} --detached {name} {GROUP} {placed}")
    assert got.returncode == 0, got.stderr[-3000:]
    head = got.stdout.splitlines()[0]
    assert head.startswith("tpcache serving 'cli-t' in namespace 'cli': TP=2, capacity 4,096")
    joined = got.stdout.split("Ray cluster ")[1].split()[0]
    assert f"tpcache.connect('cli-t', 'cli', address='{joined}')" in got.stdout
    stop = f"tpcache stop --name cli-t --namespace cli --address {joined}"
    assert f"`{stop}`" in got.stdout and "ray kill" not in got.stdout

    assert _frontend("cli-t", a, nodes.env) == {
        "client": "RayClient",
        "paths": ["ray", "ray"],  # --transport ray reached the group
        "prefix": [0, 40],
    }

    again = nodes.run(f"serve --address {a} --detached {name} {GROUP}")
    assert again.returncode == 1 and "Traceback" not in again.stderr
    said, how = said_lines(again.stderr)
    assert said.startswith(
        "tpcache serve: a coordinator is already serving as 'cli-t' in namespace 'cli' (TP=2, "
        "capacity 4,096 tokens, 0 running requests, "
    )
    assert said.endswith(" steps done).") and " 0 steps done" not in said  # the one in use
    assert how == f"  Stop it with `{stop}`, or add --replace to stop it and serve this one."

    # --replace, in the foreground this time; then SIGTERM ends it cleanly
    proc = _serve_in_background(
        f"--address {a} --replace {name} {GROUP}".split(), nodes.env, nodes.root
    )
    try:
        text = wait_for(nodes.root / "serve.out", "SIGTERM here", proc, 240)
        assert "TP=2, capacity 4,096 tokens, 0 running requests, 0 steps done" in text  # new one
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        print(f"SIGTERM to serve: exit 0 in {time.monotonic() - t0:.1f} s")
    finally:
        end([proc], "never-matches-anything")
    err = (nodes.root / "serve.err").read_text()
    assert said_lines(err) == ["tpcache serve: stopping 'cli-t'"], err
    assert "Traceback" not in err and "SystemExit" not in err

    gone = nodes.run(f"stop --address {a} {name}")
    assert gone.returncode == 1
    assert said_lines(gone.stderr) == [
        f"tpcache stop: no coordinator named 'cli-t' in namespace 'cli' on the Ray cluster at {joined}"
    ]


def test_a_taken_metrics_port_is_one_line_and_leaves_nothing(nodes) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        name = "--name cli-m --namespace cli"
        got = nodes.run(f"serve --address {nodes.address} {name} {GROUP} --metrics-port {port}")
    assert got.returncode == 2
    assert said_lines(got.stderr) == [
        f"tpcache serve: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
    ]
    left = nodes.run(f"stop --address {nodes.address} {name}")
    assert left.returncode == 1 and "no coordinator named 'cli-m'" in left.stderr


def test_serve_without_address_prints_the_cluster_it_started(tmp_path) -> None:
    """A frontend joins the printed address; ``tpcache stop`` there ends the serve."""
    root = Path(tempfile.mkdtemp(prefix="tpcll", dir="/tmp"))
    home = root / "home"
    home.mkdir()
    env = {**clean_env(home), "RAY_TMPDIR": str(root)}
    name = "--name cli-l --namespace cli"
    proc = _serve_in_background(f"{name} {GROUP}".split(), env, root)
    try:
        text = wait_for(root / "serve.out", "SIGTERM here", proc, 240)
        line = next(ln for ln in text.splitlines() if ln.startswith("  Ray cluster "))
        address = line.split()[2].rstrip(",")
        assert line == f"  Ray cluster {address}, started by this command: it ends when it does"
        assert _frontend("cli-l", address, env)["prefix"] == [0, 40]
        stopped = run_tpcache(f"stop --address {address} {name}".split(), env)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert stopped.stdout.startswith("stopped 'cli-l' in namespace 'cli' (TP=2")
        assert proc.wait(60) == 0  # it saw its coordinator go
        err = (root / "serve.err").read_text()
        assert "'cli-l' was stopped elsewhere" in err and "Traceback" not in err
    finally:
        end([proc], str(root))
        shutil.rmtree(root, ignore_errors=True)
