"""The scaled token rule (``trace.scaled_prompt_tokens``), ``replay --scale`` and the
``--scale`` argument: the slice ``tpcache generate`` runs through a model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from tpcache.cli.args import scale_arg
from tpcache.replay import ReplayOptions, infinite_capacity, replay
from tpcache.trace import (
    DEFAULT_TRACE,
    TraceError,
    TraceRequest,
    load_trace,
    output_tokens,
    prompt_tokens,
    scaled_output_length,
    scaled_prompt_tokens,
)


def test_scale_one_is_the_rule_and_lengths_round_up() -> None:
    for req in load_trace(DEFAULT_TRACE, 30):
        assert np.array_equal(scaled_prompt_tokens(req, 1), prompt_tokens(req))
        assert scaled_output_length(req, 1) == req.output_length
        for k in (2, 32, 512):
            p = scaled_prompt_tokens(req, k)
            assert p.dtype == np.int32 and p.size == -(-req.input_length // k)
            assert scaled_output_length(req, k) == -(-req.output_length // k)
            block = 512 // k
            # block j of the scaled prompt is hash id j's block of 512/k tokens
            for j, h in enumerate(req.hash_ids[: -(-p.size // block)]):
                got = p[j * block : (j + 1) * block]
                assert got.tolist() == list(range(h * block + 1, h * block + 1 + got.size))


def test_shared_hash_ids_share_exactly_their_blocks() -> None:
    a = TraceRequest(0, 0, 1500, 10, (7, 8, 9))
    b = TraceRequest(1, 0, 1500, 10, (7, 8, 4))
    for k in (1, 4, 64):
        pa, pb = scaled_prompt_tokens(a, k), scaled_prompt_tokens(b, k)
        diff = int(np.flatnonzero(pa != pb)[0])
        assert diff == 2 * 512 // k  # two blocks in common, then disjoint tokens
        assert not set(pa[diff:].tolist()) & set(pb[diff:].tolist())


@pytest.mark.parametrize("bad", [0, 3, 1024, -2, True, 2.0])
def test_bad_divisor_is_a_trace_error(bad) -> None:
    req = TraceRequest(0, 0, 10, 1, (1,))
    with pytest.raises(TraceError):
        scaled_prompt_tokens(req, bad)
    with pytest.raises(TraceError):
        ReplayOptions(capacity=None, scale=bad)


@pytest.mark.parametrize("text", ["1/3", "0.5", "2", "1/0", "1/1024", "abc", "1/-4", ""])
def test_bad_scale_argument(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        scale_arg(text)
    assert [scale_arg(t) for t in ("1", "1/1", "1/64", " 1/512 ")] == [1, 1, 64, 512]


def test_replay_scaled_counts_scaled_tokens() -> None:
    reqs = load_trace(DEFAULT_TRACE, 40)
    out = replay(reqs, ReplayOptions(capacity=None, scale=32))
    prompts = [scaled_prompt_tokens(r, 32) for r in reqs]
    assert out["prompt_tokens"] == sum(p.size for p in prompts)
    assert out["scale"] == "1/32"
    # the same count by hand: pages of each prompt equal to an earlier prompt's pages
    matched = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = min(q.size, (p.size - 1) // 16 * 16)
            diff = np.flatnonzero(p[:n] != q[:n])
            best = max(best, (int(diff[0]) if diff.size else n) // 16 * 16)
        matched += best
    assert out["matched_tokens"] == matched > 0
    assert infinite_capacity(reqs, 16, 32) == sum(
        -(-(p.size + scaled_output_length(r, 32)) // 16) * 16
        for p, r in zip(prompts, reqs, strict=True)
    )
    assert output_tokens(reqs[0])[: scaled_output_length(reqs[0], 32)].size >= 1


def test_replay_cli_takes_the_scale() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", "--limit", "40", "--scale", "1/32", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    want = replay(load_trace(DEFAULT_TRACE, 40), ReplayOptions(capacity=None, scale=32))
    assert (got["scale"], got["matched_tokens"], got["prompt_tokens"]) == (
        "1/32",
        want["matched_tokens"],
        want["prompt_tokens"],
    )
    bad = subprocess.run(
        [sys.executable, "-m", "tpcache", "replay", "--scale", "1/3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--scale" in bad.stderr
