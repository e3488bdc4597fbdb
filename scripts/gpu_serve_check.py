"""The served model on GPUs against transformers on the same GPU: one prepared check.

    .venv/bin/python scripts/gpu_serve_check.py [--tp 2] [--json out.json]

A random Llama checkpoint (GQA, llama3 RoPE scaling, tied head) written by transformers
is served by a TP group of Ray rank actors, one GPU each (``--tp``: at most the GPUs
present; NCCL between them), in bfloat16. Checked against transformers' float32 forward
on the first GPU: the logits of every prompt position after a prefill that hits the
cache (max error over the logit scale, bfloat16's precision expected), and greedy
generation through the serving engine against transformers' own bfloat16 ``generate``
(the share of equal tokens is printed; bfloat16 kernels differ, so near-ties may flip).
Exits 1 if a figure is off, 2 without CUDA. Prints the GPU and the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

LOGIT_TOL = 0.08  # of the logit scale: bfloat16 keeps about 3 significant digits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--cpu", action="store_true", help="run the same check on the CPU (gloo)")
    a = p.parse_args(argv)
    import numpy as np
    import ray
    import torch
    import transformers

    if not a.cpu and not torch.cuda.is_available():
        print(
            "gpu_serve_check: no CUDA device here (--cpu runs the check on the CPU)",
            file=sys.stderr,
        )
        return 2
    dev = "cpu" if a.cpu else "cuda"
    tp = a.tp if a.cpu else max(1, min(a.tp, torch.cuda.device_count()))
    from tpcache.coordinator.build import GroupConfig
    from tpcache.coordinator.core import CoordinatorConfig
    from tpcache.engine.config import EngineConfig
    from tpcache.engine.forward import ModelEngine, Prefill
    from tpcache.engine.loop import Engine
    from tpcache.engine.requests import Finished, GenerateRequest, SamplingParams
    from tpcache.frontend.service import start_group
    from tpcache.workers.spec import CacheSpec

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=500000.0, max_position_embeddings=4096, eos_token_id=None,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    stem = rng.integers(0, 1024, 96).tolist()
    prompts = [stem + rng.integers(0, 1024, 40).tolist() for _ in range(4)]
    report: dict = {
        "gpu": None if a.cpu else torch.cuda.get_device_name(0),
        "tp": tp,
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="tpg") as tmp:
        ref.save_pretrained(Path(tmp) / "m")
        ref = ref.to(dev)
        config = GroupConfig(
            tp=tp, capacity_tokens=1 << 14, cache=CacheSpec(page_size=16), use_gpus=not a.cpu, cpu_budget_bytes=1 << 28,
            runner="tpcache.model.llama:LlamaRunner",
            runner_args={"model": str(Path(tmp) / "m"), "dtype": "bfloat16"},
            coordinator=CoordinatorConfig(auto_recover=False), timeout_s=120.0,
        )  # fmt: skip
        ray.init(include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        coord = start_group(config)
        try:
            worst = 0.0
            eng = ModelEngine(coord)
            for i, toks in enumerate(prompts):
                out = eng.step([Prefill(f"p{i}", toks)], all_logits=True)[0]
                eng.finish(f"p{i}")
                with torch.no_grad():
                    want = ref(torch.tensor([toks], device=dev)).logits[0].float().cpu()
                got = out.logits
                tail = want[len(toks) - got.shape[0] :].numpy()
                worst = max(worst, float(np.abs(got - tail).max() / np.abs(tail).max()))
                report.setdefault("prefix_lens", []).append(out.prefix_len)
            report["max_logit_error_over_scale"] = round(worst, 5)
            engine = Engine(coord, EngineConfig(), vocab=1024)
            engine.start()
            ends: dict = {}
            done = threading.Event()

            def sink(ev) -> None:
                if isinstance(ev, Finished):
                    ends[ev.rid] = list(ev.tokens)
                    if len(ends) == len(prompts):
                        done.set()

            for i, toks in enumerate(prompts):
                engine.submit(GenerateRequest(i, toks, SamplingParams(32, ignore_eos=True)), sink)
            done.wait(300)
            engine.close()
            half = ref.to(torch.bfloat16)
            same = total = 0
            for i, toks in enumerate(prompts):
                with torch.no_grad():
                    seq = half.generate(torch.tensor([toks], device=dev), max_new_tokens=32,
                                        min_new_tokens=32, do_sample=False, pad_token_id=0)  # fmt: skip
                theirs = seq[0, len(toks) :].tolist()
                mine = ends.get(i, [])
                run = next((k for k in range(32) if k >= len(mine) or mine[k] != theirs[k]), 32)
                same, total = same + run, total + 32
            report["greedy_tokens_equal_before_first_difference"] = f"{same}/{total}"
        finally:
            coord.close()
            ray.shutdown()
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    ok = worst <= LOGIT_TOL and report["prefix_lens"][1:] == [96] * (len(prompts) - 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
