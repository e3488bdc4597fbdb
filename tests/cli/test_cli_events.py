"""``tpcache events`` at an endpoint where no publisher answers says so in one line and
exits 2 within ``--connect-timeout`` (default 5 s); at a publisher that sends nothing
within ``--timeout`` it says that and exits 1. Before, both exited 0 saying nothing (or
waited for good without --timeout). The commands run as real processes; the publisher
is tpcache's own, on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tpcache.cache.events import AllBlocksCleared
from tpcache.events.publisher import EventConfig, EventPublisher

TPCACHE = [sys.executable, "-m", "tpcache", "events"]
ASK = "is a coordinator serving KV events there (tpcache serve --events-endpoint)?"


def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    got = subprocess.run([*TPCACHE, *args], capture_output=True, text=True, timeout=60)
    return got, time.monotonic() - t0


def one_line(got: subprocess.CompletedProcess, code: int) -> str:
    assert "Traceback" not in got.stderr, got.stderr
    assert got.returncode == code, (got.returncode, got.stderr)
    assert got.stdout == ""
    lines = got.stderr.splitlines()
    assert len(lines) == 1, got.stderr
    return lines[0]


@pytest.fixture
def closed_port() -> Iterator[str]:
    """A loopback TCP endpoint where nothing listens (a port bound, not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    with EventPublisher(
        EventConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    ) as pub:
        yield pub


def test_nothing_listening_is_said_within_the_connect_timeout(closed_port: str) -> None:
    got, took = run("--endpoint", closed_port, "--connect-timeout", "1")
    line = one_line(got, 2)
    assert line.startswith(f"tpcache events: nothing published at {closed_port} within 1 s: ")
    assert "connect attempt(s) failed (refused or unreachable)" in line and line.endswith(ASK)
    assert took < 20


def test_a_missing_socket_file(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'no-such.sock'}"
    line = one_line(run("--endpoint", endpoint, "--connect-timeout", "0.5")[0], 2)
    assert line.startswith(f"tpcache events: nothing published at {endpoint} within 0.5 s")


def test_the_replay_endpoint_given_as_the_events_endpoint(publisher: EventPublisher) -> None:
    """A ROUTER answers the TCP connect but ends the handshake with a SUB."""
    endpoint = publisher.replay_endpoint
    assert endpoint is not None
    line = one_line(run("--endpoint", endpoint, "--connect-timeout", "1")[0], 2)
    assert f"nothing published at {endpoint} within 1 s: " in line


def test_a_quiet_publisher_is_reached_and_said_to_be_quiet(publisher: EventPublisher) -> None:
    got, _ = run("--endpoint", publisher.endpoint, "--timeout", "0.5")
    assert got.returncode == 1 and got.stdout == "" and "Traceback" not in got.stderr
    assert got.stderr.splitlines() == [
        f"tpcache events: reading KV events from {publisher.endpoint}; stops after 0.5 s "
        "without a batch",
        f"tpcache events: no KV events from {publisher.endpoint} in 0.5 s (a publisher answered)",
    ]


def test_a_batch_from_a_reached_publisher_is_printed(publisher: EventPublisher) -> None:
    proc = subprocess.Popen(
        [*TPCACHE, "--endpoint", publisher.endpoint, "--count", "1", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            publisher.publish([AllBlocksCleared()])  # until the SUB has subscribed
            time.sleep(0.2)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.endswith("BlockStored=0 BlockRemoved=0 AllBlocksCleared=1\n")


@pytest.mark.parametrize("bad", ["0", "-1", "inf"])
def test_a_connect_timeout_that_is_no_time(bad: str) -> None:
    line = one_line(run("--connect-timeout", bad)[0], 2)
    assert line.startswith("tpcache events: --connect-timeout must be > 0 s")


def test_the_subscriber_alone_refuses_in_time(closed_port: str) -> None:
    """The Python API's own: EventSubscriber(connect_timeout=...) raises, closing what it
    opened (its context is terminated: no socket left open)."""
    from tpcache.events.subscriber import EventSubscriber, EventSubscriberError

    ctx = zmq.Context()
    try:
        with pytest.raises(EventSubscriberError, match="nothing published at"):
            EventSubscriber(closed_port, context=ctx, connect_timeout=0.3)
    finally:
        ctx.term()  # would block on a socket left open
