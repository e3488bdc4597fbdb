"""Real checkpoint families through tpcache against transformers' own forward.

Each family's tiny checkpoint is written by transformers' model classes
(``save_pretrained``) and run by ``LlamaRunner(model=DIR)`` on a TP group of thread
ranks over gloo, through the cache: chunked prefill, greedy decode, then a second
request that hits the first one's prefix. Its logits must equal transformers' float32
forward over the same tokens (within 1e-4 of the logits' scale) and its greedy tokens
be transformers' greedy tokens. Qwen3's checkpoint is sharded (an index and several
files), the others are one file; the sliding-window Qwen2 runs with the hybrid cache
(its sliding layer's KV in the SWA pool).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import numpy as np
import pytest
import torch
from hf_checkpoints import FAMILIES, hf_logits, hf_model, write_checkpoint
from runner_helpers import LLAMA, base_cache, hybrid_cache, runner_engine

from tpcache.model.hf_config import read_hf_config
from tpcache.model.llama import LlamaSpec, llama_reference_logits

SEED = 4100
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its directory)."""
    print(f"seed={SEED}")
    out = {}
    for i, family in enumerate(FAMILIES):
        model = hf_model(family, SEED + i)
        path = tmp_path_factory.mktemp(family)
        sharded = {"max_shard_size": "100KB"} if family == "qwen3" else {}
        out[family] = (model, write_checkpoint(model, path, **sharded))
    assert (out["qwen3"][1] / "model.safetensors.index.json").is_file()
    assert len(list(out["qwen3"][1].glob("*.safetensors"))) > 1
    return out


def _check(got: np.ndarray, want, what: str) -> float:
    want = want.numpy()
    err = float(np.abs(got - want).max())
    assert err <= REL_TOL * float(np.abs(want).max()), f"{what}: max abs error {err}"
    return err


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_through_the_cache_equals_transformers(checkpoints, family, tp):
    model, path = checkpoints[family]
    # the sliding layers of qwen2_swa keep their window in the hybrid cache's SWA pool
    cache = hybrid_cache(8) if family == "qwen2_swa" else base_cache()
    _serve_like_transformers(model, path, tp, cache, f"{family} tp={tp}")


def test_fewer_kv_heads_than_ranks_are_copied_to_each_rank(checkpoints, tmp_path):
    """Llama 3.2 style (8 query heads, 2 KV heads) at TP=4, and one KV head (multi-query)
    at TP=2: each rank holds a copy of the KV head its query heads use."""
    model, path = checkpoints["llama32"]
    _serve_like_transformers(model, path, 4, base_cache(), "llama32 tp=4")
    mqa = hf_model("llama2", SEED + 99, num_key_value_heads=1)
    _serve_like_transformers(mqa, write_checkpoint(mqa, tmp_path), 2, base_cache(), "mqa tp=2")


def _serve_like_transformers(model, path, tp: int, cache, what: str) -> None:
    """Chunked prefill and greedy decode of one request, then a second one that hits its
    prefix, through ``LlamaRunner(model=path)`` on ``tp`` ranks: every logit within
    REL_TOL of transformers', every greedy token transformers' own."""
    rng = np.random.default_rng(SEED)
    prompt = [int(t) for t in rng.integers(0, 256, 22)]
    other = prompt[:16] + [int(t) for t in rng.integers(0, 256, 6)]
    eng = runner_engine(tp, LLAMA, {"model": str(path)}, cache, 256)
    start = time.perf_counter()
    try:
        errs = []
        _, logits = eng.prefill("a", prompt, chunk=8)
        gen = [int(logits[-1].argmax())]
        rows = [logits]
        for _ in range(5):
            out = eng.decode("a", gen[-1])
            rows.append(out.logits)
            gen.append(int(out.logits[-1].argmax()))
        want = hf_logits(model, prompt + gen[:-1])
        errs.append(_check(np.concatenate(rows), want, f"{what} prefill+decode"))
        # greedy: each token is transformers' argmax over the same prefix
        assert gen == [int(t) for t in want[len(prompt) - 1 :].argmax(-1)], what
        eng.finish("a", gen[:-1])
        # a second request sharing the first 16 prompt tokens: a prefix-cache hit
        hit, out = eng.admit("b", other)
        assert hit == 16, hit
        gen_b = [int(out.logits[-1].argmax())]
        rows_b = [out.logits]
        for _ in range(3):
            out = eng.decode("b", gen_b[-1])
            rows_b.append(out.logits)
            gen_b.append(int(out.logits[-1].argmax()))
        want_b = hf_logits(model, other + gen_b[:-1])[hit:]
        errs.append(_check(np.concatenate(rows_b), want_b, f"{what} after a hit"))
        assert gen_b == [int(t) for t in want_b[len(other) - hit - 1 :].argmax(-1)], what
        eng.finish("b", gen_b[:-1])
    finally:
        eng.coord.close()
    print(f"{what}: max abs logit error {max(errs):.2e} ({time.perf_counter() - start:.2f}s)")


def _as_transformers4(config: dict) -> dict:
    """The same config as transformers 4.x writes it: rope_theta and rope_scaling at the
    top level (the old ``type`` key for the scaling type), torch_dtype."""
    cfg = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(config["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg["torch_dtype"] = "float32"
    cfg["transformers_version"] = "4.46.0"
    return cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_config_written_the_transformers_4_way_computes_the_same(checkpoints, family, tmp_path):
    model, path = checkpoints[family]
    new = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in new and "rope_theta" not in new  # transformers 5's way
    (tmp_path / "config.json").write_text(json.dumps(_as_transformers4(new)))
    old_cfg, new_cfg = read_hf_config(tmp_path), read_hf_config(path)
    assert old_cfg == new_cfg, (old_cfg, new_cfg)
    spec = LlamaSpec.from_args(str(tmp_path / "config.json"), weights=str(path))
    tokens = list(range(5, 250, 9))
    _check(llama_reference_logits(spec, tokens).numpy(), hf_logits(model, tokens), family)


def test_each_familys_own_part_changes_its_logits(checkpoints):
    """llama3 scaling, sliding windows, Qwen2's biases and Qwen3's q/k norms each change
    these checkpoints' logits: a runner that ignored one would fail the comparisons above."""
    tokens = list(range(3, 200, 7))
    for family, plain_fields in (
        ("llama31", {"rope_scaling": None}),
        ("llama32", {"rope_scaling": None}),
        ("mistral_swa", {"swa_layers": (), "window": None}),
        ("qwen2_swa", {"swa_layers": (), "window": None}),
    ):
        model, path = checkpoints[family]
        spec = dataclasses.replace(LlamaSpec.from_args(model=str(path)), **plain_fields)
        plain = llama_reference_logits(spec, tokens)
        assert float((plain - hf_logits(model, tokens)).abs().max()) > 1e-2, family
    for family, part, value in (("qwen2", "_proj.bias", 0.0), ("qwen3", "_norm.weight", 1.0)):
        model = copy.deepcopy(checkpoints[family][0])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".self_attn." in name and name.endswith(part):
                    p.fill_(value)
        diff = hf_logits(model, tokens) - hf_logits(checkpoints[family][0], tokens)
        assert float(diff.abs().max()) > 1e-2, family
