"""What a long replay shows while it runs (tpcache.replay.Progress): a counter on a
terminal, plain timed lines anywhere else, nothing for a short run."""

from __future__ import annotations

import io

from tpcache.replay import Progress, ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE, load_trace


def test_off_a_terminal_it_writes_lines_after_a_quiet_start_then_at_intervals() -> None:
    # read at construction (0.0), then once per call
    times = iter([0.0, 1.0, 4.9, 5.0, 9.0, 14.9, 15.0, 16.4])
    out = io.StringIO()
    p = Progress(out, tty=False, clock=lambda: next(times), quiet_s=5.0, every_s=10.0)
    for done in (100, 200, 300, 400, 500, 600, 1000):
        p(done, 1000)
    assert out.getvalue() == (
        "replay: 300/1,000 requests (30%), 5 s\n"
        "replay: 600/1,000 requests (60%), 15 s\n"
        "replay: 1,000/1,000 requests (100%), 16 s\n"
    )


def test_off_a_terminal_a_short_run_writes_nothing() -> None:
    times = iter([0.0, 1.0, 2.0, 4.99])
    out = io.StringIO()
    p = Progress(out, tty=False, clock=lambda: next(times))
    for done in (100, 200, 250):
        p(done, 250)
    assert out.getvalue() == ""


def test_a_run_that_ends_past_the_quiet_time_gets_its_one_line() -> None:
    times = iter([0.0, 1.0, 7.0])
    out = io.StringIO()
    p = Progress(out, tty=False, clock=lambda: next(times))
    p(100, 120)
    p(120, 120)
    assert out.getvalue() == "replay: 120/120 requests (100%), 7 s\n"


def test_on_a_terminal_it_rewrites_one_counter_and_ends_the_line() -> None:
    out = io.StringIO()
    p = Progress(out, tty=True, clock=lambda: 0.0)
    for done in (100, 200, 250):
        p(done, 250)
    assert out.getvalue() == "\r  100/250 requests\r  200/250 requests\r  250/250 requests\n"


def test_a_stream_that_is_not_a_terminal_gets_plain_lines() -> None:
    assert Progress(io.StringIO()).tty is False


def test_replay_reports_every_100_requests_and_the_last() -> None:
    calls: list[tuple[int, int]] = []
    replay(
        load_trace(DEFAULT_TRACE, 250),
        ReplayOptions(capacity=None),
        lambda done, total: calls.append((done, total)),
    )
    assert calls == [(100, 250), (200, 250), (250, 250)]
