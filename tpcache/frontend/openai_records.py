"""The OpenAI completion request as the HTTP endpoint reads it, and the JSON it answers:
plain parsing and building, no sockets, no engine (``openai_http`` serves them).

What is read (``parse_completion``): ``model`` (must be the served name: else 404
``model_not_found``), ``prompt`` (token ids, a list of token-id lists, a string or a
list of strings; text only with a tokenizer; 64 prompts at most), ``max_tokens`` (16),
``temperature`` (1, OpenAI's default), ``top_p``, ``seed``, ``stop`` (up to 4 strings,
with a tokenizer), ``stream``, ``stream_options.include_usage``, ``n`` (1 only),
``user`` (ignored), and vLLM's ``top_k`` (-1 or 0: all), ``ignore_eos``,
``stop_token_ids``. OpenAI fields this endpoint does not implement (``echo``,
``logprobs``, ``best_of``, ``suffix``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``) are refused by name unless they carry their default; a field OpenAI
does not define is refused as OpenAI refuses it ("Unrecognized request argument"), so
a client never believes a setting applied that was silently dropped. A refusal is an
``ApiError`` carrying OpenAI's error body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpcache.engine.requests import BadSampling, SamplingParams, check_prompt
from tpcache.errors import TpcacheError

MAX_PROMPTS = 64  # prompts in one request: each is an engine request of its own
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 512  # each is looked for after every token: its length bounds that work

# Known, not implemented: refused unless the value is one of these defaults.
UNSUPPORTED = {
    "echo": (None, False),
    "logprobs": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
}
SUPPORTED = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
        "stream_options", "n", "user", "top_k", "ignore_eos", "stop_token_ids",
    }
)  # fmt: skip
# BadSampling names the engine's field first; the client knows OpenAI's name.
ENGINE_NAMES = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "a stop token id": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


class ApiError(TpcacheError):
    """A request the endpoint answers with an error: the HTTP ``status`` and OpenAI's
    ``{"error": {message, type, param, code}}`` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def sampling_error(exc: BadSampling, default_param: str = "prompt") -> ApiError:
    """``exc`` as a 400 naming OpenAI's field (the engine names its own)."""
    text = str(exc)
    for engine_name, param in ENGINE_NAMES.items():
        if text.startswith(engine_name + " "):
            return bad(param + text[len(engine_name) :], param)
    return bad(text, default_param)


Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CompletionAsk:
    """One checked completion request: its prompts (text or token ids, in choice order),
    the sampling every prompt gets, its stop strings and how to answer."""

    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_default(value: object, defaults: tuple[object, ...]) -> bool:
    # True == 1 in Python: a bool is a default only where False/None is listed as one.
    if isinstance(value, bool):
        return any(d is value for d in defaults)
    return any(type(d) is not bool and d == value for d in defaults)


def parse_prompts(prompt: object, has_tokenizer: bool) -> tuple[Prompt, ...]:
    """``prompt`` in any of OpenAI's four forms, as a tuple of prompts."""
    if prompt is None:
        raise bad("prompt is required", "prompt")
    if isinstance(prompt, str):
        items: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty", "prompt")  # fmt: skip
    if len(items) > MAX_PROMPTS:
        raise bad(f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if not has_tokenizer:
                raise bad("this server has no tokenizer (no tokenizer.json in its model directory): send the prompt as token ids", "prompt", "no_tokenizer")  # fmt: skip
            if not item:
                raise bad("a prompt string is empty", "prompt")
            out.append(item)
        elif isinstance(item, list):
            try:
                out.append(check_prompt(item))
            except BadSampling as exc:
                raise bad(str(exc), "prompt") from None
        else:
            raise bad(f"a prompt must be a string or a list of token ids, got {type(item).__name__}", "prompt")  # fmt: skip
    return tuple(out)


def parse_stops(stop: object, has_tokenizer: bool) -> tuple[str, ...]:
    if stop is None or stop == []:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    if max(map(len, stops)) > MAX_STOP_CHARS:
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    if not has_tokenizer:
        raise bad("this server has no tokenizer: stop strings need one; use stop_token_ids", "stop", "no_tokenizer")  # fmt: skip
    return tuple(dict.fromkeys(stops))


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {type(value).__name__}", name)
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad("stream_options may hold only include_usage", "stream_options")
    return _flag(opts, "include_usage")


def _sampling(body: dict[str, Any]) -> SamplingParams:
    def get(name: str, default: object) -> Any:
        value = body.get(name)
        return default if value is None else value

    top_k = get("top_k", 0)
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    try:
        return SamplingParams(
            max_new_tokens=get("max_tokens", 16),
            temperature=get("temperature", 1.0),
            top_k=0 if top_k == -1 and _is_int(top_k) else top_k,
            top_p=get("top_p", 1.0),
            seed=body.get("seed"),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=get("ignore_eos", False),
        )
    except BadSampling as exc:
        raise sampling_error(exc) from None


def check_model(model: str, model_name: str) -> None:
    """Raise 404 ``model_not_found`` unless ``model`` is the one served."""
    if model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{model_name}'", param="model", code="model_not_found")  # fmt: skip


def parse_completion(body: object, model_name: str, has_tokenizer: bool) -> CompletionAsk:
    """The completion request ``body`` (decoded JSON) as a ``CompletionAsk``; raises
    ``ApiError`` (400, or 404 for another model) naming the first field that is wrong.
    Changes nothing."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model is required: a string naming the model", "model")
    check_model(model, model_name)
    for name in body:
        if name in UNSUPPORTED:
            if not _is_default(body[name], UNSUPPORTED[name]):
                raise bad(f"{name} is not supported by this server (leave it out or at its default)", name, "unsupported_parameter")  # fmt: skip
        elif name not in SUPPORTED:
            raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"n must be 1 (one choice per prompt; send several prompts instead), got {n!r}", "n")  # fmt: skip
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")
    prompts = parse_prompts(body.get("prompt"), has_tokenizer)
    stream = _flag(body, "stream")
    return CompletionAsk(
        prompts=prompts,
        sampling=_sampling(body),
        stops=parse_stops(body.get("stop"), has_tokenizer),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice_body(
    index: int, text: str, token_ids: list[int], finish_reason: str | None
) -> dict[str, Any]:
    """One choice (or a streamed chunk's delta of one): ``token_ids`` is this endpoint's
    extension, the generated tokens (all of them, or the chunk's new ones)."""
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def completion_body(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A completion response, or one streamed chunk (the same object, as OpenAI sends)."""
    out: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


def model_body(model_name: str, created: int) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "tpcache"}


def models_body(model_name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model_name, created)]}
