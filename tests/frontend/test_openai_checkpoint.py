"""The OpenAI endpoint over a Hugging Face checkpoint directory, end to end against code
tpcache did not write: a tiny random Llama written by transformers, a byte-level BPE
tokenizer.json written by ``tokenizers`` beside it, served at TP=2 (thread ranks, gloo);
a text prompt's completion equals transformers' own greedy tokens, and its text the
tokenizer's decode of them, whole or streamed."""

from __future__ import annotations

import pytest
from hf_checkpoints import hf_greedy, hf_model, write_checkpoint
from runner_helpers import LLAMA, group_config
from test_openai_http import client
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.frontend.openai_http import OpenAIServer
from tpcache.workers.spec import CacheSpec


def byte_tokenizer() -> Tokenizer:
    """Every byte a token (ids 0..255: the checkpoint's vocabulary), no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def llama_served(tmp_path_factory):
    model = hf_model("llama2", seed=11)
    path = write_checkpoint(model, tmp_path_factory.mktemp("llama"))
    tokenizer = byte_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = group_config(2, LLAMA, {"model": str(path)}, CacheSpec(page_size=4, max_request_tokens=96), 256)  # fmt: skip
    coord = start_local_group(config)
    engine = Engine(coord, EngineConfig(step_tokens=64, timeout_s=60.0), vocab=256)
    engine.start()
    server = OpenAIServer(engine, model_name="tiny-llama", tokenizer_dir=str(path))
    server.start()
    try:
        yield model, tokenizer, server
    finally:
        server.close()
        engine.close()
        coord.close()


def test_text_completion_equals_transformers_greedy(llama_served) -> None:
    model, tokenizer, server = llama_served
    prompt = "Hello, tpcache!"
    ids = tokenizer.encode(prompt).ids
    assert len(ids) == len(prompt.encode())
    want = hf_greedy(model, ids, 10)
    c = client(server)
    out = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == want
    assert choice.text == tokenizer.decode(want)
    assert out.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0, stream=True))  # fmt: skip
    assert "".join(ch.text for k in chunks for ch in k.choices) == tokenizer.decode(want)
    assert [t for k in chunks for ch in k.choices for t in ch.token_ids] == want
