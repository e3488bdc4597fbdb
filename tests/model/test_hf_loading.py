"""Hugging Face checkpoints that must not load, refused by name before any rank computes:
config keys that would change the computation, missing, extra or misshapen tensors,
truncated files, heads that do not split; and what loads besides float32 (bf16, fp16,
a runner named by ``runner_options`` with ``model=DIR``)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from hf_checkpoints import hf_logits, hf_model, write_checkpoint
from runner_helpers import LLAMA, base_cache, group_config, runner_engine
from safetensors.torch import load_file, save_file

from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.forward import ModelEngine
from tpcache.model.errors import (
    ConfigKeyError,
    MissingConfigKey,
    MissingTensor,
    RunnerConfigError,
    TensorDtypeError,
    TensorShapeError,
    UnexpectedTensor,
    UnknownConfigKey,
    UnreadableCheckpoint,
    UnsupportedConfig,
)
from tpcache.model.hf_config import read_hf_config
from tpcache.model.llama import LlamaRunner, LlamaSpec, llama_reference_logits
from tpcache.model.llama_weights import load_shard
from tpcache.model.runner import RankShard
from tpcache.model.runner_spec import runner_options

SEED = 4200

LLAMA_CFG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "float32",
    "transformers_version": "5.0.0", "use_cache": True, "initializer_range": 0.02,
}  # fmt: skip
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
WITHOUT = object()  # the key removed


def _cfg(**changes) -> dict:
    cfg = {**LLAMA_CFG, **changes}
    return {k: v for k, v in cfg.items() if v is not WITHOUT}


@pytest.mark.parametrize(
    ("cfg", "error", "key"),
    [
        (_cfg(model_type="gemma"), UnsupportedConfig, "model_type"),
        (_cfg(num_experts=8), UnknownConfigKey, "num_experts"),
        (_cfg(num_local_experts=8), UnknownConfigKey, "num_local_experts"),
        (_cfg(quantization_config={"bits": 4}), UnknownConfigKey, "quantization_config"),
        (_cfg(some_new_knob=1.5), UnknownConfigKey, "some_new_knob"),
        (_cfg(sliding_window=None), UnknownConfigKey, "sliding_window"),  # not a llama key
        (_cfg(mlp_bias=True), UnsupportedConfig, "mlp_bias"),
        (_cfg(hidden_act="gelu"), UnsupportedConfig, "hidden_act"),
        (_cfg(attention_bias="yes"), UnsupportedConfig, "attention_bias"),
        (_cfg(hidden_size=WITHOUT), MissingConfigKey, "hidden_size"),
        (_cfg(num_key_value_heads=0), UnsupportedConfig, "num_key_value_heads"),
        (_cfg(num_key_value_heads=3), UnsupportedConfig, "num_key_value_heads"),
        (_cfg(rms_norm_eps="tiny"), UnsupportedConfig, "rms_norm_eps"),
        (_cfg(eos_token_id=[2, "end"]), UnsupportedConfig, "eos_token_id"),
        (
            _cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            UnsupportedConfig,
            "rope_parameters.rope_type",
        ),
        (
            _cfg(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            UnsupportedConfig,
            "rope_parameters.rope_type",
        ),
        (
            _cfg(rope_parameters={**LLAMA3, "attention_factor": 1.0}),
            UnknownConfigKey,
            "rope_parameters.attention_factor",
        ),
        (
            _cfg(rope_parameters={**LLAMA3, "factor": None}),
            MissingConfigKey,
            "rope_parameters.factor",
        ),
        (
            _cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            UnsupportedConfig,
            "rope_parameters.partial_rotary_factor",
        ),
        (_cfg(rope_theta=5e5), UnsupportedConfig, "rope_theta"),  # disagrees with rope_parameters
        (
            _cfg(rope_parameters=WITHOUT, rope_scaling={"type": "longrope", "factor": 2.0}),
            UnsupportedConfig,
            "rope_scaling.rope_type",
        ),
        (_cfg(layer_types=["full_attention", "sliding_attention"]), UnsupportedConfig, "layer_types"),
        (
            _cfg(model_type="mistral", attention_bias=WITHOUT, mlp_bias=WITHOUT, sliding_window=1),
            UnsupportedConfig,
            "sliding_window",
        ),
        (
            _cfg(model_type="mistral", attention_bias=WITHOUT, mlp_bias=WITHOUT, sliding_window=8, layer_types=["full_attention"] * 2),
            UnsupportedConfig,
            "layer_types",
        ),
        (
            _cfg(model_type="mistral", mlp_bias=WITHOUT, sliding_window=None),
            UnknownConfigKey,
            "attention_bias",  # Mistral has none
        ),
        (
            _cfg(model_type="qwen2", attention_bias=WITHOUT, mlp_bias=WITHOUT, use_sliding_window=True, sliding_window=None),
            UnsupportedConfig,
            "use_sliding_window",
        ),
        (
            _cfg(model_type="qwen3", mlp_bias=WITHOUT, layer_types=["sliding_attention"] * 2),
            UnsupportedConfig,
            "layer_types",
        ),
    ],
)  # fmt: skip
def test_a_config_that_would_compute_something_else_is_refused_by_name(tmp_path, cfg, error, key):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error) as got:
        read_hf_config(tmp_path)
    assert isinstance(got.value, ConfigKeyError) and isinstance(got.value, RunnerConfigError)
    assert got.value.key == key and repr(key) in str(got.value), str(got.value)
    with pytest.raises(error):  # the runner refuses it the same way, loading nothing
        LlamaRunner(config=str(tmp_path / "config.json"))


def test_what_the_config_gives_an_engine(tmp_path):
    """Vocabulary and end-of-sequence ids (config.json's, then generation_config.json's);
    Qwen2's implicit q/k/v biases; Qwen3's head_dim default and q/k norms; both
    transformers-4 scaling spellings."""
    (tmp_path / "config.json").write_text(json.dumps(_cfg(eos_token_id=[2, 9])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    cfg = read_hf_config(tmp_path)
    assert (cfg.vocab, cfg.eos_token_ids, cfg.max_positions) == (256, (2, 9, 11), 128)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.rope_scaling) == (False, False, False, None)
    qwen2 = _cfg(model_type="qwen2", attention_bias=WITHOUT, mlp_bias=WITHOUT, head_dim=WITHOUT)
    (tmp_path / "config.json").write_text(json.dumps({**qwen2, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 21}))  # fmt: skip
    cfg = read_hf_config(tmp_path)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.head_dim, cfg.swa_layers) == (True, False, 16, ())
    (tmp_path / "config.json").write_text(json.dumps(_cfg(model_type="qwen3", mlp_bias=WITHOUT, head_dim=None, attention_bias=True)))  # fmt: skip
    cfg = read_hf_config(tmp_path)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.head_dim) == (True, True, True, 128)
    # sliding windows: transformers counts the current token in the window, tpcache not
    (tmp_path / "config.json").write_text(json.dumps({**qwen2, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}))  # fmt: skip
    cfg = read_hf_config(tmp_path)
    assert (cfg.swa_layers, cfg.window) == ((1,), 4095)
    mistral = _cfg(model_type="mistral", attention_bias=WITHOUT, mlp_bias=WITHOUT)
    (tmp_path / "config.json").write_text(json.dumps({**mistral, "sliding_window": 4096}))
    assert (read_hf_config(tmp_path).swa_layers, read_hf_config(tmp_path).window) == ((0, 1), 4095)
    (tmp_path / "config.json").write_text(json.dumps({**mistral, "sliding_window": None}))
    assert (read_hf_config(tmp_path).swa_layers, read_hf_config(tmp_path).window) == ((), None)
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    for kind_key in ("type", "rope_type"):
        old = {**scaling, kind_key: scaling["rope_type"]}
        if kind_key == "type":
            del old["rope_type"]
        (tmp_path / "config.json").write_text(json.dumps(_cfg(rope_parameters=WITHOUT, rope_theta=5e5, rope_scaling=old)))  # fmt: skip
        cfg = read_hf_config(tmp_path)
        assert cfg.rope_theta == 5e5 and cfg.rope_scaling is not None
        assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("llama3", 8.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[object, Path]:
    print(f"seed={SEED}")
    model = hf_model("llama2", SEED, num_key_value_heads=2)
    return model, write_checkpoint(model, tmp_path_factory.mktemp("llama"))


def _variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> str:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def test_weights_that_do_not_match_the_config_are_refused_by_tensor(llama, tmp_path):
    _, src = llama
    w = load_file(src / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj.weight"
    cases = [
        (MissingTensor, q, {k: t for k, t in w.items() if k != q}),
        (UnexpectedTensor, "model.layers.0.mlp.up_proj.bias", {**w, "model.layers.0.mlp.up_proj.bias": torch.zeros(96)}),
        (TensorShapeError, q, {**w, q: w[q][:-1]}),
        (TensorDtypeError, q, {**w, q: w[q].to(torch.int8)}),
    ]  # fmt: skip
    for i, (error, name, tensors) in enumerate(cases):
        path = _variant(src, tmp_path / f"v{i}", tensors)
        with pytest.raises(error) as got:
            LlamaRunner(model=path)
        assert got.value.tensor == name and repr(name) in str(got.value), str(got.value)
    # a buffer some checkpoints carry, recomputed here: harmless
    extra = {**w, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    LlamaRunner(model=_variant(src, tmp_path / "buffer", extra))


def test_a_truncated_file_is_refused_before_any_rank_starts(llama, tmp_path):
    _, src = llama
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(UnreadableCheckpoint, match=r"model\.safetensors"):
        LlamaRunner(model=str(tmp_path))
    with pytest.raises(UnreadableCheckpoint):  # the coordinator builds the runner first
        runner_engine(2, LLAMA, {"model": str(tmp_path)}, base_cache(), 64)
    # a file cut after the coordinator's check: each rank's load refuses before reading
    (tmp_path / "model.safetensors").write_bytes(data)
    runner = LlamaRunner(model=str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(data[:7])
    with pytest.raises(UnreadableCheckpoint, match="header"):
        runner.load(RankShard(0, 1, torch.device("cpu")))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UnreadableCheckpoint, match="no safetensors file"):
        LlamaRunner(model=str(tmp_path))


def test_a_sharded_checkpoint_whose_index_disagrees_is_refused(llama, tmp_path):
    model, _ = llama
    path = write_checkpoint(model, tmp_path / "m", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    LlamaRunner(model=str(path))  # whole: loads
    (path / files[-1]).unlink()
    with pytest.raises(UnreadableCheckpoint, match="named by the index but absent"):
        LlamaRunner(model=str(path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_as_stored(tmp_path, dtype):
    """A bf16 / fp16 file loads bit for bit; computed in float32 it is transformers'
    float32 forward over the same rounded weights."""
    half = hf_model("llama2", SEED, num_key_value_heads=2).to(dtype)
    rounded = hf_model("llama2", SEED, num_key_value_heads=2)  # float32 RoPE buffers
    rounded.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    path = write_checkpoint(half, tmp_path / "half")
    stored = load_file(path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {dtype}
    spec = LlamaSpec.from_args(model=str(path))
    assert torch.equal(load_shard(spec, 0, 1)["model.norm.weight"], stored["model.norm.weight"])
    tokens = list(range(1, 120, 5))
    want = hf_logits(rounded, tokens)
    got = llama_reference_logits(spec, tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_heads_that_do_not_split_over_the_ranks_are_refused_with_the_numbers(tmp_path):
    cfg = _cfg(num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = {"config": str(tmp_path / "config.json")}  # weights drawn: the shape is the point
    with pytest.raises(RunnerConfigError, match="kv_heads=3 does not divide by tp=2"):
        group_config(2, LLAMA, args, base_cache(), 64).pool_spec()  # before any rank starts
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    with pytest.raises(RunnerConfigError, match="heads=6 and ffn=96 must divide by tp=4"):
        runner_engine(4, LLAMA, args, base_cache(), 64)  # refused as each rank loads
    with pytest.raises(RunnerConfigError, match="heads=6 and ffn=96 must divide by tp=4"):
        LlamaRunner(**args).load(RankShard(0, 4, torch.device("cpu")))


def test_a_model_directory_named_with_runner_options_serves_in_bfloat16(llama):
    """``GroupConfig(tp=2, **runner_options(LLAMA, ["model=DIR", "dtype=bfloat16"]))``."""
    model, path = llama
    options = runner_options(LLAMA, [f"model={path}", "dtype=bfloat16"])
    base = group_config(2, LLAMA, {}, base_cache(), 128)
    config = dataclasses.replace(base, **options)
    eng = ModelEngine(start_local_group(config))
    try:
        tokens = list(range(7, 140, 6))
        _, logits = eng.prefill("r", tokens, chunk=10)
        want = hf_logits(model, tokens).numpy()
        err = float(abs(logits - want).max())
        print(f"bf16 tp=2 max abs logit error {err:.3f} of {abs(want).max():.2f}")
        assert err < 0.05 * abs(want).max()
    finally:
        eng.coord.close()
    with pytest.raises(RunnerConfigError, match="drop config=/weights="):
        LlamaRunner(model=str(path), weights=str(path))


def test_a_tied_checkpoint_that_also_stores_its_head_loads_only_if_they_agree(tmp_path):
    """Some exports of tied models keep ``lm_head.weight``; transformers computes with the
    embeddings, so a head equal to them loads and one that differs is refused."""
    model = hf_model("qwen2", SEED + 1)  # tied
    src = write_checkpoint(model, tmp_path / "src")
    w = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in w
    embed = w["model.embed_tokens.weight"]
    same = LlamaRunner(
        model=_variant(src, tmp_path / "same", {**w, "lm_head.weight": embed.clone()})
    )
    same.load(RankShard(0, 1, torch.device("cpu")))
    tokens = list(range(2, 100, 3))
    want = hf_logits(model, tokens)
    got = llama_reference_logits(same.spec, tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    other = {**w, "lm_head.weight": embed + 1.0}
    runner = LlamaRunner(model=_variant(src, tmp_path / "other", other))  # headers agree
    with pytest.raises(UnexpectedTensor, match="differs from the embeddings") as got_err:
        runner.load(RankShard(1, 2, torch.device("cpu")))
    assert got_err.value.tensor == "lm_head.weight"


def test_linear_rope_scaling_equals_transformers(tmp_path):
    model = hf_model("llama2", SEED + 2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write_checkpoint(model, tmp_path)
    spec = LlamaSpec.from_args(model=str(path))
    assert spec.rope_scaling is not None and spec.rope_scaling.factor == 4.0
    tokens = list(range(9, 250, 4))
    want = hf_logits(model, tokens)
    got = llama_reference_logits(spec, tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    unscaled = llama_reference_logits(dataclasses.replace(spec, rope_scaling=None), tokens)
    assert float((unscaled - want).abs().max()) > 1e-2


def test_refusals_cross_processes_whole():
    """A rank's refusal reaches the driver as itself (Ray and process pools pickle it)."""
    for err in (
        UnknownConfigKey("/m/config.json", "num_experts", "is unknown"),
        MissingTensor("/m", "model.norm.weight", "is needed"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert getattr(back, "key", None) == getattr(err, "key", None)
        assert getattr(back, "tensor", None) == getattr(err, "tensor", None)
