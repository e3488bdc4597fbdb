"""The Llama-style runner's parts: Megatron shards of grouped-query weights, real weights
from a file, and grouped-query attention itself. (Checkpoints of real families against
transformers: test_hf_oracle.py; strict loading: test_hf_loading.py.)"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from runner_helpers import LLAMA, base_cache, runner_engine
from safetensors.torch import save_file

from tpcache.harness.modelcheck import Workload, run_workload
from tpcache.model.attention import attend
from tpcache.model.errors import (
    MissingTensor,
    TensorShapeError,
    UnexpectedTensor,
    UnreadableCheckpoint,
)
from tpcache.model.llama import LlamaReference
from tpcache.model.llama_weights import LlamaSpec, load_shard, random_weights
from tpcache.model.runner import RunnerConfigError

TOL = 1e-5


def test_megatron_shards_of_grouped_query_weights_reassemble():
    spec = LlamaSpec(seed=7, heads=8, kv_heads=2, ffn=64)
    full = random_weights(spec)
    shards = [load_shard(spec, r, 2) for r in range(2)]
    p = "model.layers.1."
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ):
        name = p + part + ".weight"  # column-parallel: [out, in], rows split
        assert torch.equal(torch.cat([s[name] for s in shards], dim=0), full[name]), name
    for part in ("self_attn.o_proj", "mlp.down_proj"):
        name = p + part + ".weight"  # row-parallel: columns split
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name]), name
    # rank 1 holds query heads 4..7 and KV head 1: exactly the KV head those queries use
    assert torch.equal(
        shards[1][p + "self_attn.k_proj.weight"], full[p + "self_attn.k_proj.weight"][8:16]
    )
    assert torch.equal(
        shards[1][p + "self_attn.q_proj.weight"], full[p + "self_attn.q_proj.weight"][32:64]
    )
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert all(torch.equal(s[name], full[name]) for s in shards)
    with pytest.raises(RunnerConfigError, match="divide by tp=3"):
        load_shard(spec, 0, 3)
    # fewer KV heads than ranks: rank r holds a copy of KV head r * kv_heads // tp
    k = p + "self_attn.k_proj.weight"
    for rank in range(4):
        got = load_shard(spec, rank, 4)[k]
        assert torch.equal(got, full[k][rank // 2 * 8 : rank // 2 * 8 + 8]), rank


def test_grouped_query_attention_uses_each_query_heads_own_kv_head():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(5, h, 4, generator=g) for h in (6, 2, 2))
    pos = torch.arange(5)
    got = attend(q, k, v, pos, pos, None).view(5, 6, 4)
    for h in range(6):  # query heads 0-2 use KV head 0, 3-5 KV head 1
        kv = h // 3
        scores = (q[:, h] @ k[:, kv].T) / 2.0 + torch.triu(torch.full((5, 5), float("-inf")), 1)
        assert torch.allclose(got[:, h], torch.softmax(scores, -1) @ v[:, kv], atol=1e-6)
    with pytest.raises(ValueError, match="evenly"):
        attend(q, k[:, :1].expand(5, 4, 4), v[:, :1].expand(5, 4, 4), pos, pos, None)


def _checkpoint(tmp_path, spec: LlamaSpec, dtype=torch.bfloat16) -> str:
    path = tmp_path / "model.safetensors"
    save_file({k: t.to(dtype) for k, t in random_weights(spec).items()}, path)
    return str(path)


def test_real_weights_from_safetensors_equal_full_recompute_at_tp2(tmp_path):
    """A checkpoint in bf16 with Hugging Face names (and a config.json) loads shard by
    shard; the batched cached path over it equals the full recompute over the same file."""
    seed = 8300
    print(f"seed={seed}")
    shape = LlamaSpec(seed=seed, heads=4, kv_heads=2, hidden=32, ffn=48, tie_embeddings=True)
    weights = _checkpoint(tmp_path, shape)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "head_dim": 8,
    }))  # fmt: skip
    args = {"config": str(config), "weights": weights}
    spec = LlamaSpec.from_args(**args)
    assert spec == dataclasses.replace(shape, weights=weights, seed=0)  # seed: unused
    shard = load_shard(spec, 1, 2)
    assert (
        shard["model.embed_tokens.weight"].dtype == torch.bfloat16 and "lm_head.weight" not in shard
    )
    eng = runner_engine(2, LLAMA, args, base_cache(), 192)
    try:
        ref = LlamaReference(spec)
        wl = Workload(seed=seed, requests=8, chunk=6, concurrency=3)
        rep = run_workload(eng, ref, wl, tol=TOL)
        assert rep.ok(TOL) and rep.hit_tokens > 0 and rep.greedy_checked > 0, rep
        # the file's weights, not the seed's: a model drawn from another seed disagrees
        other = LlamaReference(dataclasses.replace(shape, seed=seed + 1))
        seq = list(range(1, 20))
        assert not np.allclose(
            ref.full_logits(seq, "float32"), other.full_logits(seq, "float32"), atol=1e-2
        )
    finally:
        eng.coord.close()


def test_checkpoints_that_do_not_match_the_model_are_refused(tmp_path):
    spec = LlamaSpec(seed=1, heads=4, kv_heads=2, hidden=32, ffn=48)
    weights = random_weights(spec)
    cases = [
        (MissingTensor, {k: t for k, t in weights.items() if k != "lm_head.weight"}),
        (UnexpectedTensor, {**weights, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
        (TensorShapeError, {**weights, "model.norm.weight": torch.ones(31)}),
    ]
    for error, tensors in cases:
        path = tmp_path / "w.safetensors"
        save_file(tensors, path)
        with pytest.raises(error):
            load_shard(dataclasses.replace(spec, weights=str(path)), 0, 2)
    with pytest.raises(UnreadableCheckpoint, match="no such file"):
        load_shard(dataclasses.replace(spec, weights=str(tmp_path / "none")), 0, 2)
    config = tmp_path / "scaled.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_attention_heads": 4,
        "intermediate_size": 48, "num_hidden_layers": 2, "rope_scaling": {"type": "yarn"},
    }))  # fmt: skip
    with pytest.raises(RunnerConfigError, match=r"'rope_scaling\.rope_type' is 'yarn'"):
        LlamaSpec.from_args(config=str(config))
