"""Two parts of ``bench_serve.py`` that run in its own process: the CPU a decode step costs
around the model's forward (a TP=2 group of Ray ranks with the coordinator and engine
here), and transformers' own ``generate`` on the same checkpoint."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from serve_bench_lib import median

PHASES = ("apply_cpu_s", "prepare_cpu_s", "agree_cpu_s", "result_cpu_s")


def overhead_part(
    model: Path,
    batch: int,
    new_tokens: int,
    capacity: int,
    page: int,
    seed: int,
    repeats: int = 3,
) -> dict[str, Any]:
    """``batch`` requests of 32 prompt tokens decode together; between the moment all
    of them have their first token and the moment all have ``new_tokens - 2`` more, the
    CPU seconds of this process (coordinator and engine), of each rank's process, and of
    the ranks' forwards (inside their runner's ``run``), per step. ``repeats`` batches
    one after the other on one group: the figures of the one with the median ratio,
    and every ratio."""
    import ray

    from tpcache.cli import build_parser
    from tpcache.cli.serve_options import serve_config
    from tpcache.engine.loop import Engine
    from tpcache.frontend.service import start_group

    args = ["serve", "--model", str(model), "--tp", "2", "--capacity", str(capacity)]
    config, serving = serve_config(build_parser().parse_args([*args, "--page-size", str(page)]))
    with tempfile.TemporaryDirectory(prefix="tpbo", dir="/tmp") as tmp:
        ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        coord = start_group(config)
        engine = Engine(coord, serving.engine, vocab=serving.vocab)
        try:
            engine.start()
            runs = [
                _measure(coord, engine, batch, new_tokens, serving.vocab, seed + r, f"r{r}")
                for r in range(repeats)
            ]
            runs.sort(key=lambda x: x["outside_over_forward"])
            return {**runs[len(runs) // 2], "ratios": [x["outside_over_forward"] for x in runs]}
        finally:
            engine.close()
            coord.close()
            ray.shutdown()


def _measure(coord, engine, batch: int, new_tokens: int, vocab: int, seed: int, tag: str):
    from tpcache.engine.requests import Failed, Finished, GenerateRequest, SamplingParams, TokenOut

    rng = np.random.default_rng(seed)
    counts = [0] * batch
    ended = [0]
    lock = threading.Condition()

    def sink_of(i: int):
        def sink(ev) -> None:
            with lock:
                if isinstance(ev, TokenOut):
                    counts[i] += 1
                elif isinstance(ev, Finished | Failed):
                    ended[0] += 1
                lock.notify_all()

        return sink

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(0, vocab, 32).tolist()
        engine.submit(GenerateRequest(f"o{tag}-{i}", prompt, params), sink_of(i))
    with lock:
        lock.wait_for(lambda: min(counts) >= 1, timeout=600)
    before = _snapshot(coord)
    with lock:
        lock.wait_for(lambda: min(counts) >= new_tokens - 1, timeout=600)
    after = _snapshot(coord)
    with lock:  # the next batch starts on a quiet group
        lock.wait_for(lambda: ended[0] == batch, timeout=600)
    steps = after["forwards"] - before["forwards"]
    d = {k: (after[k] - before[k]) / steps for k in after if k != "forwards"}
    outside = d["coordinator_cpu_s"] + d["ranks_cpu_s"] - d["forward_cpu_s"]
    phases = {k: round(d[k] * 1e3, 3) for k in PHASES}
    phases["rest"] = round(
        (d["ranks_cpu_s"] - d["forward_cpu_s"] - sum(d[k] for k in PHASES)) * 1e3, 3
    )
    return {
        "batch": batch,
        "decode_steps_measured": steps,
        "per_step_ms": {
            "wall": round(d["wall_s"] * 1e3, 3),
            "forward_wall_rank0": round(d["forward_wall_s"] * 1e3, 3),
            "forward_cpu_all_ranks": round(d["forward_cpu_s"] * 1e3, 3),
            "ranks_cpu_outside_forward": round((d["ranks_cpu_s"] - d["forward_cpu_s"]) * 1e3, 3),
            "coordinator_and_engine_cpu": round(d["coordinator_cpu_s"] * 1e3, 3),
        },
        # Where the ranks' share goes (both ranks): applying the step's ops, decoding and
        # checking the forward's command, the agreement on it, the reply, and the rest
        # (the channel, Ray's own threads).
        "ranks_outside_forward_ms": phases,
        "outside_over_forward": round(outside / d["forward_cpu_s"], 4),
        "target": 0.10,
        "within_target": outside <= 0.10 * d["forward_cpu_s"],
    }


def _snapshot(coord) -> dict[str, float]:
    with coord.lock:  # the engine's thread drives the ranks too
        times = coord.ranks.call("model_times")
    return {
        "wall_s": time.perf_counter(),
        "coordinator_cpu_s": time.process_time(),
        "forwards": times[0]["forwards"],
        "forward_wall_s": times[0]["run_wall_s"],
        "forward_cpu_s": sum(t["run_cpu_s"] for t in times),
        "ranks_cpu_s": sum(t["process_cpu_s"] for t in times),
        **{k: sum(t[k] for t in times) for k in PHASES},
    }


def transformers_tps(model: Path, prompts: list[list[int]], new_tokens: int, repeats: int):
    """Tokens per second of transformers' greedy ``generate`` over ``prompts`` as one
    batch (all of one length), at one torch thread (as a rank runs) and at the
    machine's default."""
    import torch
    import transformers

    m = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    out: dict[str, float] = {}
    default = torch.get_num_threads()
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        spans = []
        with torch.no_grad():
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                got = m.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                spans.append(time.perf_counter() - t0)
        assert got.shape == (len(prompts), ids.shape[1] + new_tokens)
        out[f"threads_{threads}"] = round(len(prompts) * new_tokens / median(spans[1:]), 1)
    torch.set_num_threads(default)
    return out
