"""The served model on GPUs (bfloat16, NCCL) against transformers on the same GPU:
``scripts/gpu_serve_check.py``, opt-in (``-m gpu``) and skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_served_bf16_model_matches_transformers_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from gpu_serve_check import main

    assert main(["--tp", "2"]) == 0
