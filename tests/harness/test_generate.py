"""``tpcache generate``: prefill computed with the cache equals ``replay``'s prompt - matched
on the same scaled slice; bad input refused before anything starts; a client that goes
away mid-request leaves nothing held; the CLI's JSON. Thread ranks over a real gloo group,
a tiny reference model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

from tpcache.cli import main
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.forward import ModelEngine
from tpcache.harness.gen_loop import GenLoop, LoopConfig
from tpcache.harness.gen_wire import (
    GenClient,
    GenerateError,
    Refused,
    Submit,
    Token,
    decode_reply,
    encode,
    pack,
)
from tpcache.harness.generate import (
    GenerateOptions,
    ModelSize,
    group_config,
    run_generate,
    scaled_requests,
)
from tpcache.replay import ReplayOptions, replay
from tpcache.trace import DEFAULT_TRACE, TraceRequest, load_trace, scaled_prompt_tokens

TINY = ModelSize(hidden=32, heads=4, ffn=64, layers=1)


def _check_equal_to_replay(trace: list[TraceRequest], opts: GenerateOptions) -> dict:
    out = run_generate(trace, opts)
    # the replay, computed here on the same scaled slice, not read from the summary
    rp = replay(trace, ReplayOptions(capacity=None, page_size=opts.page_size, scale=opts.scale))
    on, off = out["cache"], out["no_cache"]
    prompts = sum(scaled_prompt_tokens(r, opts.scale).size for r in trace)
    assert on["prompt_tokens"] == off["prompt_tokens"] == rp["prompt_tokens"] == prompts
    assert on["matched_tokens"] == rp["matched_tokens"] > 0
    assert on["prefill_tokens_computed"] == rp["prompt_tokens"] - rp["matched_tokens"]
    assert off["matched_tokens"] == 0 and off["prefill_tokens_computed"] == prompts
    assert on["finished"] == off["finished"] == len(trace)
    assert (
        on["generated_tokens"]
        == off["generated_tokens"]
        == sum(r.max_new for r in scaled_requests(trace, opts.scale))
    )
    assert on["held_tokens_end"] == off["held_tokens_end"] == 0
    assert out["rank_digests_equal"] and out["prefill_equals_replay"]
    return out


def test_prefill_equals_replay_on_the_conversation_trace() -> None:
    trace = load_trace(DEFAULT_TRACE, 10)
    _check_equal_to_replay(trace, GenerateOptions(scale=32, clients=4, model=TINY))


def test_prefill_equals_replay_when_concurrent_prompts_share() -> None:
    """Requests that share long prefixes arrive together: the later ones must wait for
    the earlier prefill, or they would compute what replay matches."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    trace = []
    for i in range(14):  # pairs share 2-5 blocks; a pair's blocks are its own
        stem = [100 * (i // 2) + j for j in range(int(rng.integers(2, 6)))]
        ids = (*stem, *(int(h) for h in rng.integers(10_000, 20_000, size=2)))
        n = (len(ids) - 1) * 512 + int(rng.integers(1, 512))
        trace.append(TraceRequest(i, 0, n, int(rng.integers(1, 200)), ids))
    out = _check_equal_to_replay(
        trace, GenerateOptions(scale=32, clients=6, step_tokens=64, model=TINY)
    )
    assert out["cache"]["admission_waits"] > 0  # the rule was exercised
    assert out["no_cache"]["admission_waits"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": 3},
        {"scale": 0},
        {"clients": 0},
        {"tp": 0},
        {"step_tokens": 0},
        {"page_size": 0},
        {"capacity": 4},
        {"tp": 3},  # 4 heads do not split over 3 ranks
        {"timeout_s": 0.0},
    ],
)
def test_bad_options_are_generate_errors(kwargs) -> None:
    with pytest.raises(GenerateError):
        GenerateOptions(**{"model": TINY, **kwargs})


def test_bad_model_and_empty_slice() -> None:
    for bad in ({"hidden": 30, "heads": 4}, {"hidden": 12, "heads": 4}, {"layers": 0}):
        with pytest.raises(GenerateError):
            ModelSize(**bad)
    with pytest.raises(GenerateError):
        scaled_requests([], 32)
    with pytest.raises(GenerateError):
        run_generate([], GenerateOptions(model=TINY))
    with pytest.raises(GenerateError):
        LoopConfig(step_tokens=0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--scale", "1/3"],
        ["--scale", "0.5"],
        ["--clients", "0"],
        ["--limit", "0"],
        ["--tp", "0"],
        ["--heads", "3"],
        ["--hidden", "30"],
        ["--policy", "nope"],
        ["--step-tokens", "-1"],
        ["--timeout", "0"],
    ],
)
def test_bad_arguments_stop_before_anything_starts(argv, monkeypatch, capsys) -> None:
    def started(*a, **k):
        raise AssertionError("a group was started")

    monkeypatch.setattr("tpcache.coordinator.local_ranks.start_local_group", started)
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv])
    assert exc.value.code == 2
    assert "tpcache generate: error:" in capsys.readouterr().err


def test_a_client_gone_mid_request_leaves_nothing_held() -> None:
    trace = load_trace(DEFAULT_TRACE, 2)
    reqs = scaled_requests(trace, 32)
    opts = GenerateOptions(scale=32, model=TINY, capacity=2048)  # room for 400 outputs
    coord = start_local_group(group_config(opts, reqs))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    got: dict[str, object] = {}

    def leaver() -> None:  # asks for 400 tokens, reads the first, goes away
        s = ctx.socket(zmq.DEALER)
        s.connect(endpoint)
        s.send(encode(Submit(0, pack(reqs[0].prompt), 400)))
        assert s.poll(60_000)
        got["first"] = decode_reply(s.recv())
        s.close(linger=0)

    def stayer() -> None:  # a malformed frame, a wrong seq, then request 1 in full
        s = ctx.socket(zmq.DEALER)
        s.connect(endpoint)
        s.send(b"\x93not a submit")
        assert s.poll(60_000)
        got["malformed"] = decode_reply(s.recv())
        s.send(encode(Submit(7, pack(reqs[1].prompt), 3)))
        assert s.poll(60_000)
        got["unawaited"] = decode_reply(s.recv())
        s.close(linger=0)
        client = GenClient(ctx, endpoint, 60.0)
        got["result"] = client.generate(1, reqs[1].prompt, 3)
        client.close()

    errors: list[BaseException] = []

    def guarded(f):
        def run() -> None:
            try:
                f()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (leaver, stayer)]
    try:
        loop = GenLoop(ModelEngine(coord), router, LoopConfig(step_tokens=64, idle_timeout_s=60))
        for t in threads:
            t.start()
        c = loop.serve(2)
        for t in threads:
            t.join(60)
        assert not errors, errors
        coord.sync()
        assert (c.finished, c.dropped, c.refused) == (1, 1, 0)
        assert c.generated < 400  # it stopped decoding for the client that left
        assert isinstance(got["first"], Token) and got["first"].index == 0
        assert isinstance(got["malformed"], Refused) and got["malformed"].seq == -1
        assert isinstance(got["unawaited"], Refused) and got["unawaited"].seq == 7
        result = got["result"]
        assert result.tokens.size == 3 and result.ttft_s <= result.e2e_s
        sizes = coord.mirror.sizes()
        assert sizes.held == 0 and not coord.mirror.running_ids()
        digests = coord.ranks.call("digest")
        assert all(int(d) == coord.mirror.digest() for d in digests)
    finally:
        router.close(linger=0)
        ctx.destroy(linger=0)  # a client thread's socket too, if an assert stopped it
        coord.close()


def test_the_cli_prints_one_json_object(tmp_path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpcache",
            "generate",
            "--limit",
            "10",
            "--scale",
            "1/32",
            "--hidden",
            "32",
            "--ffn",
            "64",
            "--layers",
            "1",
            "--clients",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    # Each run's socket directory goes with it (two were left per command).
    assert list(tmp_path.glob("tpcache-generate-*")) == []
    s = json.loads(run.stdout)
    rp = replay(load_trace(DEFAULT_TRACE, 10), ReplayOptions(None, 16, scale=32))
    assert (s["requests"], s["scale"], s["tp"], s["clients"]) == (10, "1/32", 2, 3)
    assert s["model"]["hidden"] == 32 and s["model"]["num_layers"] == 1
    for mode in ("cache", "no_cache"):
        m = s[mode]
        for key in ("e2e_s", "tokens_per_s", "ttft_ms_p50", "ttft_ms_p99"):
            assert m[key] > 0, (mode, key)
        assert m["ttft_ms_p50"] <= m["ttft_ms_p99"]
        assert m["held_tokens_end"] == 0 and m["rank_digests_equal"]
    assert s["cache"]["prefill_tokens_computed"] == rp["prompt_tokens"] - rp["matched_tokens"]
    assert s["no_cache"]["prefill_tokens_computed"] == rp["prompt_tokens"]
    hit = s["cache"]["hit_rate"]
    assert s["time_target"] == round(1 - hit / 2, 4)
    assert s["time_ratio"] == round(s["cache"]["e2e_s"] / s["no_cache"]["e2e_s"], 4)
    assert s["prefill_equals_replay"] and s["nothing_held"]
