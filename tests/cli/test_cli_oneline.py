"""Input the CLI refuses in one line: exit code 2, one line on stderr that names the
problem, no traceback, and nothing started (no Ray cluster, no model, no file written).

Commands run as real processes. A command that would join a Ray cluster is given an
address where nothing listens, so one that got past its checks fails fast there instead
of starting a cluster (and says so, which these tests do not accept)."""

from __future__ import annotations

import gzip
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TPCACHE = [sys.executable, "-m", "tpcache"]
# Enough for the interpreter and torch; far below any model these tests ask for, so a
# command that tried to allocate one fails at once instead of filling the machine.
ADDRESS_SPACE = 16 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [*TPCACHE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=_limit_memory,
    )


def refused(got: subprocess.CompletedProcess, *said: str) -> str:
    """The one line ``got`` wrote on stderr, after checking it was refused with it and
    that the line says each of ``said``."""
    assert "Traceback" not in got.stderr, got.stderr
    lines = got.stderr.splitlines()
    assert len(lines) == 1, got.stderr
    assert got.returncode == 2, (got.returncode, got.stderr)
    for words in said:
        assert words in lines[0], (words, lines[0])
    return lines[0]


@pytest.fixture
def nowhere() -> Iterator[str]:
    """A Ray address where nothing listens (a port bound, not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


GOOD = b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n'
LATIN1 = (
    b'{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [2], "n": "caf\xe9"}\n'
)


@pytest.fixture(params=["plain", "gzip"])
def latin1_trace(request, tmp_path: Path) -> Path:
    """A trace whose second line is Latin-1, not UTF-8 (its 0xe9 at byte 83)."""
    data = GOOD + LATIN1 + GOOD
    if request.param == "gzip":
        path = tmp_path / "trace.jsonl.gz"
        path.write_bytes(gzip.compress(data))
    else:
        path = tmp_path / "trace.jsonl"
        path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "command", [["replay"], ["generate", "--limit", "3"], ["demo", "--limit", "3"]]
)
def test_a_trace_that_is_not_utf8_is_named_with_its_line(
    command: list[str], latin1_trace: Path, nowhere: str
) -> None:
    address = ["--address", nowhere] if command[0] == "demo" else []
    line = refused(
        run(command[0], str(latin1_trace), *command[1:], *address),
        f"tpcache {command[0]}: {latin1_trace}: line 2: not UTF-8",
        "byte 0xe9 at byte 83",
    )
    assert "nothing answers" not in line


def test_a_binary_file_given_as_a_trace(tmp_path: Path) -> None:
    """A file that is no text at all (an image) is named at its first byte."""
    path = tmp_path / "image.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    refused(run("replay", str(path)), f"{path}: line 1: not UTF-8 text (byte 0x89 at byte 1 ")


def test_keys_never_writes_over_a_file(tmp_path: Path) -> None:
    path = tmp_path / "events.secret"
    path.write_text("in use\n")
    got = run("keys", str(path))
    refused(got, f"tpcache keys: {path} exists already")
    assert got.stdout == ""  # no public key for a secret key that was not kept
    assert path.read_text() == "in use\n"


def test_keys_into_a_missing_directory(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "events.secret"
    got = run("keys", str(path))
    refused(got, f"tpcache keys: no directory {path.parent} to create {path}")
    assert got.stdout == "" and not path.parent.exists()


def test_keys_onto_a_directory(tmp_path: Path) -> None:
    refused(run("keys", str(tmp_path)), f"{tmp_path} exists already (a directory)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--hidden", "100000000"], ["weights 1.3 EB", "hidden 100,000,000", "smaller model"]),
        pytest.param(
            ["--capacity", "1e12"],
            ["KV pool 16.4 PB", "smaller capacity"],
            # On a GPU the pool takes what the device has room for, whatever is asked.
            marks=pytest.mark.skipif(_cuda(), reason="the KV pool is on the GPUs"),
        ),
    ],
)
def test_generate_refuses_a_run_larger_than_the_machine(
    options: list[str], said: list[str]
) -> None:
    """Refused before anything is allocated: under an address-space limit of 16 GiB, a
    command that tried to allocate these would fail in torch with a traceback."""
    refused(
        run("generate", "--limit", "4", *options),
        "tpcache generate: the run needs about",
        "of memory, more than the",
        *said,
    )


EVENTS_ALONE = [
    ["--events-curve-secret-file", "/nonexistent"],
    ["--events-replay-endpoint", "tcp://127.0.0.1:5558"],
    ["--events-topic", "kv"],
    ["--events-buffer", "5"],
    ["--events-encoding", "array"],
    ["--events-curve-client-keys-file", "/nonexistent"],
    ["--events-insecure"],
]


@pytest.mark.parametrize("option", EVENTS_ALONE, ids=lambda o: o[0])
def test_serve_refuses_an_events_option_without_an_events_endpoint(
    option: list[str], nowhere: str
) -> None:
    refused(
        run("serve", *option, "--address", nowhere),
        f"tpcache serve: {option[0]} needs --events-endpoint",
    )


def test_serve_names_every_option_given_alone(nowhere: str) -> None:
    refused(
        run("serve", "--events-topic", "kv", "--events-insecure", "--address", nowhere),
        "--events-topic and --events-insecure need --events-endpoint",
    )


def test_serve_refuses_a_metrics_host_without_a_metrics_port(nowhere: str) -> None:
    refused(
        run("serve", "--metrics-host", "0.0.0.0", "--address", nowhere),
        "tpcache serve: --metrics-host needs --metrics-port",
    )


def test_the_weights_counted_are_the_weights_drawn() -> None:
    """The size ``generate`` refuses by is what the reference model allocates."""
    from tpcache.harness.gen_memory import weight_bytes
    from tpcache.model.reference import ModelSpec, full_weights

    spec = ModelSpec(vocab=97, hidden=24, heads=3, head_dim=8, ffn=40, num_layers=3)
    drawn = sum(t.numel() * t.element_size() for t in full_weights(spec).values())
    assert weight_bytes(hidden=24, ffn=40, layers=3, vocab=97) == drawn


# ---- --capacity too small for the workload: one check shared by every command ----------
BIGGEST = "--capacity 100 holds 96 tokens (6 pages of 16), but a request of this workload holds"


@pytest.mark.parametrize(
    "command",
    [
        ["replay", "--limit", "5"],
        ["demo", "--limit", "5"],
        ["demo", "data:trace", "--limit", "5"],
        ["generate", "--limit", "5", "--scale", "1/1"],
    ],
    ids=["replay", "demo-synthetic", "demo-trace", "generate"],
)
def test_a_capacity_smaller_than_a_request_is_refused_before_anything_starts(
    command: list[str], nowhere: str
) -> None:
    """Before the fix: ``demo`` and ``generate`` raised the cache's InvalidTokens (a
    traceback) at the first such request, after the cluster or the model had started."""
    from tpcache.trace import DEFAULT_TRACE

    args = [str(DEFAULT_TRACE) if a == "data:trace" else a for a in command]
    address = ["--address", nowhere] if command[0] == "demo" else []
    line = refused(
        run(*args, "--capacity", "100", *address), f"tpcache {command[0]}: {BIGGEST}", "give"
    )
    assert "nothing answers" not in line


@pytest.mark.parametrize("command", ["replay", "demo", "generate", "serve"])
def test_a_capacity_below_one_page_is_refused_in_one_line(command: str, nowhere: str) -> None:
    address = ["--address", nowhere] if command in ("demo", "serve") else []
    refused(
        run(
            command, "--capacity", "10", "--limit" if command != "serve" else "--tp", "2", *address
        ),
        f"tpcache {command}: --capacity 10 is less than one page of 16 tokens (--page-size): "
        "give --capacity 16 or more",
    )


def test_replay_checks_the_sliding_window_pool_too() -> None:
    refused(
        run("replay", "--limit", "5", "--swa-window", "64", "--swa-capacity", "100"),
        "tpcache replay: --swa-capacity 100 holds 96 tokens",
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_capacity_check_draws_the_line_where_the_cache_does(page_size: int) -> None:
    """The largest request the check lets through is the largest the cache admits."""
    import numpy as np

    from tpcache.cache import CacheConfig, RadixCache
    from tpcache.cache.errors import InvalidTokens
    from tpcache.cli.capacity import Need, capacity_problem

    capacity = 100
    holds = capacity // page_size * page_size
    fits, over = Need(holds - 3, 3), Need(holds - 2, 3)
    assert capacity_problem(capacity, page_size, fits) is None
    said = capacity_problem(capacity, page_size, over)
    assert said is not None and f"give --capacity {holds + page_size} or more" in said
    cache = RadixCache(CacheConfig(capacity_tokens=capacity, page_size=page_size))
    cache.admit(1, np.arange(1, fits.prompt + 1, dtype=np.int32), reserve=fits.output)
    with pytest.raises(InvalidTokens):
        cache.admit(2, np.arange(1, over.prompt + 1, dtype=np.int32), reserve=over.output)
