"""The OpenAI endpoint driven by the official ``openai`` client: a token-id completion
equals the engine's own greedy output, streamed or not, one choice per prompt; text
prompts and stop strings through a tokenizer built here (a word-level ``tokenizers``
model saved as tokenizer.json). Thread ranks over a real gloo group, a tiny reference
model, a real engine and real HTTP on loopback."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.engine.requests import Failed, Finished, GenerateRequest, SamplingParams
from tpcache.frontend.openai_http import OpenAIServer
from tpcache.workers.spec import CacheSpec

VOCAB = 64
WORDS = ["[UNK]", *(f"{a}{b}" for a in "bdkmpst" for b in "aeiou"), *(f"x{i}" for i in range(28))]
assert len(WORDS) == VOCAB
MODEL = {"vocab": VOCAB, "hidden": 32, "heads": 4, "head_dim": 8, "ffn": 64, "num_layers": 1}


def tiny_group(tp: int = 2) -> GroupConfig:
    return GroupConfig(
        tp=tp,
        capacity_tokens=2048,
        cache=CacheSpec(page_size=4, max_request_tokens=1024),
        cpu_budget_bytes=1 << 24,
        timeout_s=60.0,
        runner="tpcache.model.reference:ReferenceRunner",
        runner_args=MODEL,
        coordinator=CoordinatorConfig(auto_recover=False),
    )


def write_tokenizer(directory: Path) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    coord = start_local_group(tiny_group())
    engine = Engine(coord, EngineConfig(step_tokens=256, max_batch=16, timeout_s=60.0), vocab=VOCAB)
    engine.start()
    tok_dir = tmp_path_factory.mktemp("ckpt")
    tokenizer = write_tokenizer(tok_dir)
    plain = OpenAIServer(engine, model_name="tiny")
    text = OpenAIServer(engine, model_name="tiny", tokenizer_dir=str(tok_dir))
    plain.start()
    text.start()
    try:
        yield engine, plain, text, tokenizer
    finally:
        plain.close()
        text.close()
        engine.close()
        coord.close()


def client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def engine_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The engine's own answer, asked directly (no HTTP)."""
    done = threading.Event()
    got: list[object] = []

    def sink(event: object) -> None:
        if isinstance(event, Finished | Failed):
            got.append(event)
            done.set()

    sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    engine.submit(GenerateRequest(f"ref-{uuid.uuid4().hex}", tuple(prompt), sampling), sink)
    assert done.wait(60)
    assert isinstance(got[0], Finished) and got[0].reason == "length"
    return list(got[0].tokens)


PROMPTS = [[3, 9, 14, 2, 7, 7, 30], [5, 1], [40, 41, 42, 43, 44, 45, 46, 47, 48, 12, 13]]


def test_token_prompt_equals_the_engines_greedy_output(served) -> None:
    engine, plain, _, _ = served
    want = engine_greedy(engine, PROMPTS[0], 9)
    out = client(plain).completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny"
    (choice,) = out.choices
    assert choice.index == 0 and choice.text == "" and choice.finish_reason == "length"
    assert choice.token_ids == want  # the extension: the tokens, without a tokenizer
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (7, 9, 16)  # fmt: skip
    # the same prompt ran just before: its whole pages (4 tokens) came from the cache
    assert out.usage.prompt_tokens_details.cached_tokens == 4


def test_stream_gives_the_same_tokens_and_usage(served) -> None:
    engine, plain, _, _ = served
    want = engine_greedy(engine, PROMPTS[2], 12)
    chunks = list(
        client(plain).completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *token_chunks, last = chunks
    got = [t for c in token_chunks for ch in c.choices for t in ch.token_ids]
    assert got == want
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    reasons = [ch.finish_reason for c in token_chunks for ch in c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert all(c.usage is None and "usage" in c.model_fields_set for c in token_chunks)
    assert last.choices == [] and last.usage.prompt_tokens == 11
    assert last.usage.completion_tokens == 12 and last.usage.total_tokens == 23


def test_several_prompts_are_several_choices(served) -> None:
    engine, plain, _, _ = served
    want = [engine_greedy(engine, p, 5) for p in PROMPTS]
    c = client(plain)
    out = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=5, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in out.choices] == want
    assert out.usage.prompt_tokens == sum(map(len, PROMPTS)) and out.usage.completion_tokens == 15
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = {}
    for chunk in c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=5, temperature=0, stream=True):  # fmt: skip
        for ch in chunk.choices:
            streamed[ch.index] += ch.token_ids
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert [streamed[i] for i in range(3)] == want
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_concurrent_clients_each_get_their_own_answer(served) -> None:
    engine, plain, _, _ = served
    prompts = [[(7 * i + j) % VOCAB for j in range(3 + i % 5)] for i in range(8)]
    want = [engine_greedy(engine, p, 6) for p in prompts]
    got: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        c = client(plain)
        stream = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, temperature=0, stream=bool(i % 2))  # fmt: skip
        got[i] = [t for k in stream for ch in k.choices for t in ch.token_ids] if i % 2 else stream.choices[0].token_ids  # fmt: skip

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(8)] == want


def test_stop_token_ids_and_a_seeded_sample(served) -> None:
    engine, plain, _, _ = served
    greedy = engine_greedy(engine, PROMPTS[0], 9)
    stop_at = next(i for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2)
    c = client(plain)
    out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9, temperature=0, extra_body={"stop_token_ids": [greedy[stop_at]]})  # fmt: skip
    assert out.choices[0].token_ids == greedy[: stop_at + 1]  # the stop token is part of it
    assert out.choices[0].finish_reason == "stop"
    ask = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.5, "seed": 7}
    a, b = c.completions.create(**ask), c.completions.create(**ask, extra_body={"top_k": 20})
    again = c.completions.create(**ask)
    assert a.choices[0].token_ids == again.choices[0].token_ids  # one seed, one answer
    assert len(b.choices[0].token_ids) == 8


def test_text_prompt_and_stop_strings_with_a_tokenizer(served) -> None:
    engine, _, text, tokenizer = served
    prompt = "ba ke mi po su ta"
    ids = tokenizer.encode(prompt).ids
    assert ids == [WORDS.index(w) for w in prompt.split()]
    want = engine_greedy(engine, ids, 10)
    full = tokenizer.decode(want)
    c = client(text)
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].token_ids == want and out.choices[0].text == full
    assert out.usage.prompt_tokens == len(ids)
    # A stop string: the 4th generated word. The text ends before its first occurrence,
    # the tokens run up to the one that completed it.
    stop = full.split(" ")[3]
    cut = full.index(stop)
    upto = next(m for m in range(1, 11) if stop in tokenizer.decode(want[:m]))
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stop=[stop, "never"])  # fmt: skip
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, choice.token_ids) == (full[:cut], "stop", want[:upto])  # fmt: skip
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True))  # fmt: skip
    assert "".join(ch.text for k in chunks for ch in k.choices) == full[:cut]
    assert [t for k in chunks for ch in k.choices for t in ch.token_ids] == want[:upto]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # text and token-id prompts in one server
    out = c.completions.create(model="tiny", prompt=[prompt, "ba ke"], max_tokens=3, temperature=0)
    assert out.choices[0].token_ids == want[:3]
    assert out.choices[1].token_ids == engine_greedy(engine, ids[:2], 3)


def test_models_and_health(served) -> None:
    _, plain, _, _ = served
    models_ = client(plain).models.list()
    assert [m.id for m in models_.data] == ["tiny"]
    assert client(plain).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as exc:
        client(plain).models.retrieve("other")
    assert exc.value.body["code"] == "model_not_found"
    import json
    import urllib.request

    with urllib.request.urlopen(plain.url + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
