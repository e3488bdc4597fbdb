"""What a served model gains from the prefix cache, and what serving costs around the model.

    .venv/bin/python scripts/bench_serve.py                 # all four parts (~10 min here)
    .venv/bin/python scripts/bench_serve.py --parts ttft,overhead --json out.json

A random Llama checkpoint written by transformers (``--hidden``, ``--layers``...), served
by ``tpcache serve --model`` processes (local Ray, CPU ranks) and driven by the network
client, in four parts, each printing its figures with the machine:

- ``ttft``: TP=2; time to first token of a 2,048-token prompt sent cold (nothing cached)
  and of one whose first 90% was a finished request's prompt (median of ``--repeats``
  each, fresh random prompts every time).
- ``sharing``: TP=2; the first ``--limit`` requests of the Mooncake conversation trace,
  every length scaled by ``1/--scale``, token ids renumbered densely (a one-to-one map, so
  what matches is what ``tpcache replay`` matches), each generating its scaled output
  length greedily; ``--clients`` clients, request i sent by client i % clients after its
  previous one ended, sent in trace order (a turnstile and a 3 ms gap between sends). Served twice in one run, with the prefix cache and
  without it (``--no-prefix-cache``), both with ``--ordered-admission``: prefill tokens
  computed (the engine's count) against prompt - matched of ``tpcache replay`` on the
  slice, and end-to-end time with the cache against ``1 - hit rate / 2`` of the time
  without.
- ``overhead``: TP=2, in this process (Ray ranks, the coordinator and engine here):
  ``--batch`` requests decoding together; per decode step, the CPU seconds inside the
  ranks' forwards (the model) and outside them (this process, and the ranks' processes
  beyond their forwards: applying steps, checking the forward's command, the reply,
  the rest), over three batches one after the other: the median batch's figures and
  each batch's ratio.
- ``tps``: ``tpcache serve --tp 1`` at batch 1 and ``--batch``, tokens generated per
  second as the clients see them, against transformers' own ``generate`` on the same
  checkpoint in this process (greedy, the same prompts), in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench_lib import ModelShape, Served, machine, median, timed_stream, write_checkpoint
from serve_parts import overhead_part, transformers_tps

PAGE = 16
# Clients send over sockets of their own, which the server reads round robin: calls sent
# microseconds apart could be read out of order. A gap keeps trace order at the server.
SEND_GAP_S = 0.003


def ttft_part(a: argparse.Namespace, model: Path, shape: ModelShape) -> dict[str, Any]:
    from tpcache.client import NetworkClient

    rng = np.random.default_rng(a.seed)
    n, shared = 2048, -(-2048 * 9 // 10 // PAGE) * PAGE  # 90%, in whole pages
    cold, warm, cached = [], [], []
    with Served(model, 2, a.capacity, PAGE, []) as srv, NetworkClient(srv.endpoint) as c:
        c.generate(rng.integers(0, shape.vocab, 64).tolist(), 2)  # warm-up
        for _ in range(a.repeats):
            base = rng.integers(0, shape.vocab, n).tolist()
            cold.append(timed_stream(c, base, 1).ttft_s)  # cold, then cached whole
            other = base[:shared] + rng.integers(0, shape.vocab, n - shared).tolist()
            got = timed_stream(c, other, 1)
            warm.append(got.ttft_s)
            cached.append(got.cached_tokens)
    ratio = median(warm) / median(cold)
    return {
        "prompt_tokens": n,
        "shared_tokens": shared,
        "cached_tokens_seen": sorted(set(cached)),
        "cold_ttft_ms_median": round(median(cold) * 1e3, 1),
        "cached_ttft_ms_median": round(median(warm) * 1e3, 1),
        "cold_ttft_ms": [round(x * 1e3, 1) for x in cold],
        "cached_ttft_ms": [round(x * 1e3, 1) for x in warm],
        "ratio": round(ratio, 4),
        "target": 0.25,
        "within_target": ratio <= 0.25,
    }


def trace_slice(limit: int, scale: int) -> tuple[list[list[int]], list[int], int, Any]:
    from tpcache.trace import DEFAULT_TRACE, load_trace, scaled_output_length, scaled_prompt_tokens

    reqs = load_trace(DEFAULT_TRACE, limit=limit)
    prompts = [scaled_prompt_tokens(r, scale) for r in reqs]
    ids = np.unique(np.concatenate(prompts))
    dense = [np.searchsorted(ids, p).tolist() for p in prompts]
    outs = [scaled_output_length(r, scale) for r in reqs]
    return dense, outs, int(ids.size), reqs


def replay_matched(reqs: Any, scale: int) -> dict[str, int]:
    from tpcache.replay import ReplayOptions, replay

    got = replay(reqs, ReplayOptions(None, page_size=PAGE, scale=scale))
    return {"prompt_tokens": got["prompt_tokens"], "matched_tokens": got["matched_tokens"]}


def run_clients(endpoint: str, prompts: list[list[int]], outs: list[int], clients: int):
    """Every request, by ``clients`` client threads; a turnstile keeps the sends in trace
    order (request i goes out after request i - 1 has). Returns (wall seconds, replies)."""
    from tpcache.client import NetworkClient

    replies: list[Any] = [None] * len(prompts)
    turn = threading.Condition()
    sent = [0]

    def client(k: int) -> None:
        with NetworkClient(endpoint) as c:
            for i in range(k, len(prompts), clients):
                with turn:
                    turn.wait_for(lambda i=i: sent[0] == i)
                    pending = c.generate(prompts[i], outs[i], ignore_eos=True, stream=True)
                    time.sleep(SEND_GAP_S)  # the call is out; let the server read it first
                    sent[0] += 1
                    turn.notify_all()
                list(pending)
                replies[i] = pending.result

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, replies


def sharing_part(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    prompts, outs, _, reqs = trace_slice(a.limit, a.scale)
    want = replay_matched(reqs, a.scale)
    modes = {}
    for name, extra in (("cache", []), ("no_cache", ["--no-prefix-cache"])):
        flags = ["--ordered-admission", "--step-tokens", str(a.step_tokens), *extra]
        with Served(model, 2, a.capacity, PAGE, flags) as srv:
            e2e, replies = run_clients(srv.endpoint, prompts, outs, a.clients)
        modes[name] = {
            "e2e_s": round(e2e, 3),
            "prompt_tokens": sum(r.prompt_tokens for r in replies),
            "cached_tokens": sum(r.cached_tokens for r in replies),
            "prefill_tokens": sum(r.computed_tokens for r in replies),
            "generated_tokens": sum(len(r.tokens) for r in replies),
            "preemptions": sum(r.preemptions for r in replies),
            "recoveries": sum(r.recoveries for r in replies),
        }
    on, off = modes["cache"], modes["no_cache"]
    hit = want["matched_tokens"] / want["prompt_tokens"]
    ratio = on["e2e_s"] / off["e2e_s"]
    return {
        "requests": len(prompts),
        "scale": f"1/{a.scale}",
        "clients": a.clients,
        "replay": want,
        "replay_hit_rate": round(hit, 4),
        **modes,
        "prefill_equals_replay": on["prefill_tokens"]
        == want["prompt_tokens"] - want["matched_tokens"],
        "time_ratio": round(ratio, 4),
        "time_target": round(1 - hit / 2, 4),
        "time_within_target": ratio <= 1 - hit / 2,
    }


def tps_part(a: argparse.Namespace, model: Path, shape: ModelShape) -> dict[str, Any]:
    from tpcache.client import NetworkClient

    rng = np.random.default_rng(a.seed + 1)
    out: dict[str, Any] = {"new_tokens": a.new_tokens, "prompt_tokens": 32}
    batches = (1, a.batch)
    prompts = {b: [rng.integers(0, shape.vocab, 32).tolist() for _ in range(b)] for b in batches}
    with Served(model, 1, a.capacity, PAGE, []) as srv:
        for b in batches:
            with NetworkClient(srv.endpoint) as c:
                c.generate(prompts[b][0], 2)  # warm-up
            spans = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                threads = [
                    threading.Thread(target=_one, args=(srv.endpoint, p, a.new_tokens))
                    for p in prompts[b]
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                spans.append(time.perf_counter() - t0)
            out[f"tpcache_batch{b}_tokens_per_s"] = round(b * a.new_tokens / median(spans), 1)
    for b in batches:
        out[f"transformers_batch{b}_tokens_per_s"] = transformers_tps(
            model, prompts[b], a.new_tokens, a.repeats
        )
    for b in batches:  # against transformers at one torch thread, as a CPU rank runs
        theirs = out[f"transformers_batch{b}_tokens_per_s"]["threads_1"]
        out[f"ratio_batch{b}_vs_one_thread"] = round(
            out[f"tpcache_batch{b}_tokens_per_s"] / theirs, 3
        )
    return out


def _one(endpoint: str, prompt: list[int], n: int) -> None:
    from tpcache.client import NetworkClient

    with NetworkClient(endpoint) as c:
        got = c.generate(prompt, n, ignore_eos=True)
        assert len(got.tokens) == n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # overhead first: it measures CPU time per step, which other processes on a small
    # machine inflate (the servers of the other parts take a while to go).
    p.add_argument("--parts", default="overhead,ttft,sharing,tps")
    p.add_argument(
        "--vocab",
        type=int,
        default=8192,
        help="the model's vocabulary; the sharing part's model has the trace slice's "
        "distinct ids if that is more (one id each), and is otherwise the same",
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--capacity", type=int, default=1 << 17, help="KV slots per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--limit", type=int, default=512, help="trace requests (sharing)")
    p.add_argument("--scale", type=int, default=64, help="trace lengths divided by this")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    report: dict[str, Any] = {"machine": machine(), "args": vars(a)}
    shape = ModelShape(a.vocab, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn)
    report["model"] = shape.as_dict()
    with tempfile.TemporaryDirectory(prefix="tpbm") as tmp:
        model = write_checkpoint(Path(tmp) / "model", shape, a.seed)
        if "sharing" in parts:
            ids = trace_slice(a.limit, a.scale)[2]
            wide = dataclasses.replace(shape, vocab=max(a.vocab, ids))
            report["sharing_model_vocab"] = wide.vocab
            sharing_model = write_checkpoint(Path(tmp) / "sharing_model", wide, a.seed)
        for part in parts:
            t0 = time.perf_counter()
            load = round(os.getloadavg()[0], 2)
            if part == "ttft":
                got = ttft_part(a, model, shape)
            elif part == "sharing":
                got = sharing_part(a, sharing_model)
            elif part == "overhead":
                got = overhead_part(model, a.batch, a.new_tokens, a.capacity, PAGE, a.seed)
            elif part == "tps":
                got = tps_part(a, model, shape)
            else:
                p.error(f"unknown part {part!r}")
            got["part_s"] = round(time.perf_counter() - t0, 1)
            got["load_avg_1m_at_start"] = load
            report[part] = got
            print(json.dumps({part: got}, indent=1), flush=True)
    report["machine"]["load_avg_1m_at_end"] = machine()["load_avg_1m_at_start"]
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    shown = ("machine", "model", "sharing_model_vocab")
    print(json.dumps({k: report[k] for k in shown if k in report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
