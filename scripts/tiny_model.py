"""Write a tiny random Hugging Face checkpoint to try `tpcache serve --model` with.

    .venv/bin/python scripts/tiny_model.py /tmp/tpcache-tiny

The weights are random (seeded), so the text it generates means nothing; the shapes are
a Llama's (hidden 64, 2 layers, 4 query heads over 2 KV heads, vocabulary 256), which
is all serving needs to show prefill, decode and cache hits in seconds on a CPU. It is
written by transformers' own model class (`pip install transformers`; `scripts/setup.sh`
installs it), so the checkpoint is laid out exactly as a real one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARK = "TINY_RANDOM_MODEL"  # the file that says this script wrote the directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "out", type=Path, help="the directory to write (a new one, or one this script wrote)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    args = p.parse_args(argv)
    # Never overwrite a real checkpoint; one this script wrote is rewritten.
    if (args.out / "config.json").exists() and not (args.out / MARK).exists():
        print(
            f"tiny_model: {args.out} already holds a checkpoint; give a new directory",
            file=sys.stderr,
        )
        return 2
    if args.vocab < 2:
        p.error(f"--vocab must be >= 2, got {args.vocab}")
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(
            f"tiny_model: {exc.name} is not installed (pip install transformers torch)",
            file=sys.stderr,
        )
        return 2
    transformers.utils.logging.disable_progress_bar()  # the script prints one line
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(args.out)
    (args.out / MARK).write_text("a random checkpoint written by scripts/tiny_model.py\n")
    print(f"a random Llama (vocab {args.vocab}, seed {args.seed}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
