"""The CLI without a Ray cluster of its own: placement options
reaching ``GroupConfig``, bad values refused by argparse, help for every option (and
torchrun's, and the README's torchrun lines), errors in one line, ``tpcache events``
saying where it reads, the demo's progress. Commands run as real processes."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpcache.cli import build_parser
from tpcache.cli.args import STRATEGIES, TRANSPORTS, group_config
from tpcache.cli.demo import DemoProgress

REPO = Path(__file__).resolve().parents[2]
TPCACHE = [sys.executable, "-m", "tpcache"]


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return subprocess.run(
        [*TPCACHE, *args], capture_output=True, text=True, timeout=timeout, env=env or base
    )


# ---- placement ---------------------------------------------------------------------------------
def test_placement_options_reach_the_group_config() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--tp",
            "3",
            "--strategy",
            "STRICT_SPREAD",
            "--gpus-per-rank",
            "0.5",
            "--rank-resources",
            "node_a=1;node_b=1,ssd=0.5;node_c=2",
            "--transport",
            "ray",
        ]
    )
    cfg = group_config(args, args.capacity)
    assert (cfg.strategy, cfg.gpus_per_rank, cfg.transport) == ("STRICT_SPREAD", 0.5, "ray")
    assert cfg.rank_resources == [{"node_a": 1}, {"node_b": 1, "ssd": 0.5}, {"node_c": 2}]
    assert [cfg.resources_of(r) for r in range(3)][1] == {"node_b": 1.0, "ssd": 0.5}
    one = group_config(parser.parse_args(["demo", "--rank-resources", "node_a=1"]), 1024)
    assert one.rank_resources == {"node_a": 1.0} and one.resources_of(1) == {"node_a": 1.0}
    plain = group_config(parser.parse_args(["demo"]), 1024)
    assert (plain.strategy, plain.gpus_per_rank, plain.rank_resources, plain.transport) == (
        "PACK",
        1.0,
        None,
        "channel",
    )
    with pytest.raises(ValueError, match="gives 2 groups for --tp 3"):
        group_config(parser.parse_args(["demo", "--tp", "3", "--rank-resources", "a=1;b=1"]), 64)


def test_the_cli_offers_what_group_config_takes() -> None:
    from tpcache.coordinator import build

    assert STRATEGIES == build.STRATEGIES and TRANSPORTS == build.TRANSPORTS


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["serve", "--strategy", "FOO"], "argument --strategy: invalid choice: 'FOO'"),
        (["demo", "--transport", "nccl"], "argument --transport: invalid choice: 'nccl'"),
        (["serve", "--gpus-per-rank", "0"], "GPUs per rank must be in (0, 64], got 0"),
        (["serve", "--gpus-per-rank", "two"], "expected a number of GPUs, got 'two'"),
        (["demo", "--rank-resources", "node_a"], "expected NAME=AMOUNT pairs"),
        (["demo", "--rank-resources", "node_a=0"], "expected NAME=AMOUNT pairs"),
        (["serve", "--rank-resources", "GPU=1"], "GPU is not a custom resource"),
        (
            ["demo", "--tp", "2", "--rank-resources", "a=1;b=1;c=1"],
            "--rank-resources gives 3 groups for --tp 2",
        ),
        (["serve", "--detached"], "--detached needs --address"),
        # Found by a red team: tracebacks, or a wrong message, before these.
        (["serve", "--capacity", "1e400"], "capacity must be a token count or 'inf'"),
        (["replay", "--capacity", "1e400"], "capacity must be a token count or 'inf'"),
        (["serve", "--policy", "bogus"], "unknown policy 'bogus'"),
        (["serve", "--metrics-port", "70000"], "expected a port from 0 to 65535, got 70000"),
        (["serve", "--metrics-port", "-1"], "expected a port from 0 to 65535, got -1"),
        (["serve", "--name="], "argument --name: expected a non-empty name"),
        (["stop", "--namespace", " "], "argument --namespace: expected a non-empty name"),
    ],
)
def test_bad_values_are_argparse_errors(args: list[str], said: str) -> None:
    got = run(*args)
    assert got.returncode == 2
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tpcache {args[0]}: error: ") and said in last, got.stderr
    assert "Traceback" not in got.stderr


# ---- help --------------------------------------------------------------------------------------
def bare_options(help_text: str) -> list[str]:
    """The options ``--help`` lists with no help: argparse writes an option's help after
    it on its line, or, when the option is long, on the next line, indented further."""
    lines = [*help_text.splitlines(), ""]
    bare = []
    for line, after in itertools.pairwise(lines):
        alone = re.match(r"^  -\S", line) and "  " not in line.strip()
        if alone and not re.match(r"^ {3,}\S", after):
            bare.append(line.strip())
    return bare


def help_of(parser: argparse.ArgumentParser, *command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    return out.getvalue()


def test_every_serve_demo_and_stop_option_has_help() -> None:
    probe = argparse.ArgumentParser()
    probe.add_argument("--told", help="said")
    probe.add_argument("--a-very-long-option-name", metavar="SOMETHING", help="said too")
    probe.add_argument("--bare")
    probe.add_argument("--a-very-long-bare-option", metavar="SOMETHING")
    assert bare_options(help_of(probe)) == ["--bare BARE", "--a-very-long-bare-option SOMETHING"]
    parser = build_parser()
    for command in ("serve", "demo", "stop", "events"):
        assert bare_options(help_of(parser, command)) == [], command
    text = run("serve", "--help").stdout
    for said in (
        "--page-size PAGE_SIZE",
        "tokens per page",
        "eviction policy",
        "actor name",
        "Ray namespace",
        "--strategy",
        "--rank-resources SPEC",
        "--replace",
    ):
        assert said in text


@functools.cache
def torchrun_help(*command: str) -> str:
    got = subprocess.run(
        [sys.executable, "-m", "tpcache.torchrun", *command, "--help"],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_torchrun_help_reads_as_a_users() -> None:
    text = " ".join(torchrun_help().split())  # argparse wraps lines
    assert "torchrun --standalone --nproc_per_node=2 -m tpcache.torchrun check" in text
    assert "``" not in text and "TorchrunRanks" not in text  # no internal notes
    check = torchrun_help("check")
    options = re.findall(r"^  (--[\w-]+)(?: [A-Z_]+)?(.*)$", check, re.MULTILINE)
    assert {o for o, _ in options} >= {"--seed", "--page-size", "--swa-capacity", "--window"}
    # argparse puts a long option's help on the next line; either way, none is bare
    lines = check.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^  --[\w-]+( [A-Z_]+)?$", line):
            assert lines[i + 1].startswith(" " * 20), line


def test_the_readme_torchrun_synopsis_can_be_pasted() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("## Test with torchrun", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [ln for ln in section.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands and all("[" not in ln and "..." not in ln for ln in commands)
    known = set(re.findall(r"--[\w-]+", torchrun_help("check")))
    start = ".venv/bin/torchrun --standalone --nproc_per_node=2 -m tpcache.torchrun check"
    for ln in commands:
        assert ln.startswith(start)
        for flag in re.findall(r"(?<= )--[\w-]+", ln[len(start) :]):
            assert flag in known, flag


# ---- errors that say what ----------------------------------------------------------------------
def test_an_unreachable_address_is_one_line() -> None:
    with socketless_port() as port:
        got = run("stop", "--address", f"127.0.0.1:{port}")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        f"tpcache stop: nothing answers at 127.0.0.1:{port} (Connection refused): is the head "
        f"up (`ray start --head --port {port}` there) and the address right?"
    ]


class socketless_port:
    """A port nothing listens on (bound, not listening, for the block's duration)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_events_shows_its_default_endpoint_and_says_where_nothing_answers() -> None:
    """Where it reads from a publisher that answers: tests/cli/test_cli_events.py."""
    assert "(default: tcp://127.0.0.1:5557)" in run("events", "--help").stdout
    with socketless_port() as port:
        got = run("events", "--endpoint", f"tcp://127.0.0.1:{port}", "--connect-timeout", "0.3")
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.startswith(f"tpcache events: nothing published at tcp://127.0.0.1:{port}")
    assert got.stderr.count("\n") == 1


# ---- the demo ----------------------------------------------------------------------------------
def test_demo_progress_off_a_terminal_lines_after_a_quiet_start() -> None:
    times = iter([0.0, 1.0, 2.9, 3.0, 5.0, 8.0, 8.5])
    out = io.StringIO()
    p = DemoProgress(out, tty=False, clock=lambda: next(times), quiet_s=3.0, every_s=5.0)
    for done, verified in ((8, 0), (16, 1), (24, 2), (32, 3), (40, 4)):
        p(done, 48, verified)
    p(48, 48, 6)
    assert out.getvalue() == (
        "demo: 24/48 requests, 2 steps verified, 3 s\n"
        "demo: 40/48 requests, 4 steps verified, 8 s\n"
        "demo: 48/48 requests, 6 steps verified, 8 s\n"
    )


def test_demo_progress_short_run_silent_and_a_counter_on_a_terminal() -> None:
    quiet = io.StringIO()
    times = iter([0.0, 1.0, 2.0])
    p = DemoProgress(quiet, tty=False, clock=lambda: next(times))
    p(8, 16, 0)
    p(16, 16, 2)
    assert quiet.getvalue() == ""
    tty = io.StringIO()
    p = DemoProgress(tty, tty=True, clock=lambda: 0.0)
    p(8, 16, 0)
    p(16, 16, 2)
    assert tty.getvalue() == (
        "\r  8/16 requests, 0 steps verified, 0 s\r  16/16 requests, 2 steps verified, 0 s\n"
    )


# ---- #19: the host tier on demo and serve -------------------------------------------------------
@pytest.mark.parametrize("cmd", ["demo", "serve"])
def test_host_tier_options_reach_the_group_config(cmd: str) -> None:
    from tpcache.cache.errors import HostTierError

    parser = build_parser()
    args = parser.parse_args([cmd, "--host-capacity", "4096", "--write-policy",
                              "write_through_selective", "--write-through-hits", "3"])  # fmt: skip
    cache = group_config(args, 1024).cache
    assert (cache.host_capacity_tokens, cache.write_policy, cache.write_through_hits) == (
        4096, "write_through_selective", 3,
    )  # fmt: skip
    assert group_config(parser.parse_args([cmd]), 1024).cache.host_capacity_tokens is None
    for bad, said in (
        (["--write-policy", "write_back"], "need --host-capacity"),
        (["--host-capacity", "64", "--write-through-hits", "2"], "needs --write-policy"),
    ):
        with pytest.raises(ValueError, match=said):
            group_config(parser.parse_args([cmd, *bad]), 1024)
    with pytest.raises(HostTierError, match="host_capacity_tokens must be"):
        group_config(parser.parse_args([cmd, "--host-capacity", "8"]), 1024)  # page 16
