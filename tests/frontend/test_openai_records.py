"""The OpenAI endpoint's parts without sockets: what a completion request may hold, and
one choice's text built token by token, cut at stop strings and held back while a stop
string may still be forming (checked against the tokenizer's own decode of all tokens)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.models import BPE

from tpcache.engine.requests import SamplingParams
from tpcache.frontend.openai_records import ApiError, CompletionAsk, parse_completion
from tpcache.frontend.openai_text import ChoiceText, TextCodec


def parse(has_tokenizer: bool = True, **fields) -> CompletionAsk:
    return parse_completion({"model": "m", **fields}, "m", has_tokenizer)


def test_every_prompt_form() -> None:
    assert parse(prompt=[5, 6]).prompts == ((5, 6),)
    assert parse(prompt=[[5], [6, 7]]).prompts == ((5,), (6, 7))
    assert parse(prompt="hi").prompts == ("hi",)
    assert parse(prompt=["a", [1], "b"]).prompts == ("a", (1,), "b")


def test_defaults_and_fields_reach_the_sampling() -> None:
    ask = parse(prompt=[1])
    assert ask.sampling == SamplingParams(max_new_tokens=16, temperature=1.0)
    assert (ask.stops, ask.stream, ask.include_usage) == ((), False, False)
    ask = parse(
        prompt=[1], max_tokens=3, temperature=0, top_p=0.5, seed=9, top_k=-1, ignore_eos=True,
        stop_token_ids=[4], stop=["x", "x", "y"], stream=True, stream_options={"include_usage": True},
        echo=False, logprobs=None, best_of=1, n=1, frequency_penalty=0.0, logit_bias={}, user="u",
    )  # fmt: skip
    assert ask.sampling == SamplingParams(3, 0.0, 0, 0.5, 9, (4,), True)
    assert (ask.stops, ask.stream, ask.include_usage) == (("x", "y"), True, True)
    assert parse(prompt=[1], max_tokens=None, temperature=None).sampling.max_new_tokens == 16


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"model": "other"}, 404, "model", "model_not_found"),
        ({"model": 3}, 400, "model", None),
        ({"echo": True}, 400, "echo", "unsupported_parameter"),
        ({"best_of": True}, 400, "best_of", "unsupported_parameter"),  # True is not 1 here
        ({"logit_bias": {"5": 1}}, 400, "logit_bias", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
        ({"suffix": "x"}, 400, "suffix", "unsupported_parameter"),
        ({"functions": []}, 400, "functions", "unknown_parameter"),
        ({"n": 3}, 400, "n", None),
        ({"n": True}, 400, "n", None),
        ({"prompt": None}, 400, "prompt", None),
        ({"prompt": [[]]}, 400, "prompt", None),
        ({"prompt": [[1]] * 65}, 400, "prompt", None),
        ({"prompt": [1.5]}, 400, "prompt", None),
        ({"prompt": ""}, 400, "prompt", None),
        ({"stop": ["a", ""]}, 400, "stop", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ({"stop": "x" * 513}, 400, "stop", None),
        ({"stream": "yes"}, 400, "stream", None),
        ({"stream": True, "stream_options": {"x": 1}}, 400, "stream_options", None),
        ({"max_tokens": 2.0}, 400, "max_tokens", None),
        ({"top_k": -2}, 400, "top_k", None),
        ({"ignore_eos": 1}, 400, "ignore_eos", None),
        ({"stop_token_ids": 5}, 400, "stop_token_ids", None),
        ({"stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ],
)
def test_refusals_name_the_field(fields, status, param, code) -> None:
    body = {"model": "m", "prompt": [1], **fields}
    with pytest.raises(ApiError) as exc:
        parse_completion(body, "m", True)
    e = exc.value
    assert (e.status, e.param, e.code) == (status, param, code), e.message
    assert e.body() == {"error": {"message": e.message, "type": e.kind, "param": param, "code": code}}  # fmt: skip
    assert e.kind == "invalid_request_error"


def test_text_needs_a_tokenizer() -> None:
    for fields in ({"prompt": "a"}, {"prompt": [1], "stop": "a"}):
        with pytest.raises(ApiError) as exc:
            parse(False, **fields)
        assert exc.value.code == "no_tokenizer" and "no tokenizer" in exc.value.message
    with pytest.raises(ApiError, match="the request body must be a JSON object"):
        parse_completion([1], "m", True)


def bytes_bpe() -> TextCodec:
    """A byte-level BPE without merges: every UTF-8 byte is a token of its own, so a
    character of several bytes spans tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextCodec(tok)


def word_level() -> TextCodec:
    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "stop", "here"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return TextCodec(tok)


def feed(ct: ChoiceText, ids: list[int]) -> list[str]:
    parts = []
    for t in ids:
        ct.push(t)
        parts.append(ct.take())
    parts.append(ct.finish())
    return parts


def test_text_comes_whole_across_byte_tokens() -> None:
    codec = bytes_bpe()
    text = "día ✓ 日本"
    ids = list(codec.encode(text))
    assert len(ids) > len(text)  # several characters span tokens
    parts = feed(ChoiceText(codec), ids)
    assert "".join(parts) == codec.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)  # never half a character


def test_stop_strings_cut_and_hold_back() -> None:
    codec = word_level()
    ids = list(codec.encode("the cat sat on the mat"))
    ct = ChoiceText(codec, ("sat on", "zz"))
    parts = feed(ct, ids)
    # "sat" could begin "sat on": held until "on" shows it does; the text ends before it
    assert parts == ["the", " cat", " ", "", "", "", ""]
    assert ct.stopped and ct.tokens == ids[:4] and ct.text == "the cat "
    ct = ChoiceText(codec, ("sat down",))
    parts = feed(ct, ids)
    assert parts == ["the", " cat", " ", "sat on", " the", " mat", ""]
    assert not ct.stopped and "".join(parts) == codec.decode(ids)
    ct = ChoiceText(codec, ("mat",))  # held back at the end, let go by finish
    assert feed(ChoiceText(codec, ("matter",)), ids)[-2:] == [" ", "mat"]
    assert "".join(feed(ct, ids)) == "the cat sat on the " and ct.stopped


def test_no_tokenizer_keeps_tokens_only() -> None:
    ct = ChoiceText(None)
    assert feed(ct, [3, 4, 5]) == ["", "", "", ""] and ct.tokens == [3, 4, 5]
