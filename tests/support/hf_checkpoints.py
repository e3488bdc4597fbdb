"""Tiny random Hugging Face checkpoints written by transformers' own model classes, and
transformers' own forward over them: the oracle the Llama-family runner is checked
against (code tpcache did not write)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# hidden 64, 2 layers, vocab 256: big enough for every part to matter, fast on a CPU
BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}

# Each family as its real checkpoints are shaped, shrunk.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2": ("LlamaConfig", {"num_key_value_heads": 4, "rope_theta": 10000.0}),
    "llama31": (  # llama3 RoPE scaling across all three frequency bands, tied head
        "LlamaConfig",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama32": (  # head_dim given (not hidden / heads), 4 query heads per KV head
        "LlamaConfig",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": (
        "MistralConfig",
        {"num_key_value_heads": 2, "sliding_window": None, "rope_theta": 1000000.0},
    ),
    "mistral_swa": (  # Mistral 7B v0.1 style: every layer slides (window 8 with itself)
        "MistralConfig",
        {"num_key_value_heads": 2, "sliding_window": 8},
    ),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2_swa": (  # layer 0 full, layer 1 sliding (window 9 with itself)
        "Qwen2Config",
        {
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 9,
            "max_window_layers": 1,
        },
    ),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),
}


def hf_model(family: str, seed: int, **overrides: Any):
    """transformers' model of ``family`` (float32, eval, eager attention) with every
    parameter redrawn from ``seed``: fan-in scaled matrices, norms near 1, biases
    nonzero (transformers' own init leaves biases at 0 and norms at 1, which would
    hide a missing bias or norm)."""
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    return model.eval()


def write_checkpoint(model, path: Path, **save: Any) -> Path:
    """``model.save_pretrained(path)``: config.json, generation_config.json, safetensors."""
    model.save_pretrained(str(path), **save)
    return path


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(tokens), vocab]`` of the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model, tokens: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``tokens`` by transformers (full recompute each)."""
    seq = list(tokens)
    for _ in range(steps):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(tokens) :]
