"""What a generate request asks for and what the engine tells its caller back: plain
records, no torch, no Ray (the network frontend and its torch-free client build and read
them too).

A request is its prompt's token ids and its ``SamplingParams``; everything is checked on
construction, so a bad request is a ``BadSampling`` (a ``ValueError``) before anything
is queued. The engine answers each request with a stream of ``TokenOut`` (one per token,
as it is sampled) ending in exactly one ``Finished`` or ``Failed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tpcache.errors import TpcacheError

MAX_SEED = 2**63 - 1
FINISH_REASONS = ("length", "stop", "cancelled")


class BadSampling(TpcacheError, ValueError):
    """A generate request's parameters are out of range (the message names the field)."""


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadSampling(f"{name} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadSampling(f"{name} must be {span}, got {value}")
    return value


def _check_float(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadSampling(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or not low <= v <= high:
        raise BadSampling(f"{name} must be in [{low}, {high}], got {value}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How the next tokens are chosen, and when to stop.

    ``temperature`` 0 is greedy (then ``top_k``, ``top_p`` and ``seed`` do not matter);
    otherwise logits are divided by it, cut to the ``top_k`` most likely (0: all) and to
    the smallest set whose probability reaches ``top_p``, and a token is drawn with a
    generator seeded by ``seed`` (None: a seed drawn at submission), so one request with
    one seed gives the same tokens on every run. Generation stops after
    ``max_new_tokens`` tokens (reason ``length``), or at a token of ``stop_token_ids`` or
    the model's end-of-sequence ids unless ``ignore_eos`` (reason ``stop``; that token is
    part of the output).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, 0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise BadSampling("top_p must be > 0 (1 keeps every token)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.stop_token_ids, tuple | list):
            raise BadSampling("stop_token_ids must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("a stop token id", t, 0, 2**31 - 1)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise BadSampling("ignore_eos must be true or false")


def check_prompt(tokens: Sequence[int]) -> tuple[int, ...]:
    """The prompt as a tuple of non-negative ints; ``BadSampling`` names what is wrong.
    (The model's vocabulary is checked by the engine, which knows it.)"""
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise BadSampling("the prompt must be a list of token ids")
    if not tokens:
        raise BadSampling("the prompt is empty: give at least one token id")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadSampling(f"a prompt token id must be an integer, got {type(t).__name__}")
        if not 0 <= t < 2**31:
            raise BadSampling(f"a prompt token id must be in [0, 2**31), got {t}")
        out.append(int(t))
    return tuple(out)


@dataclass(frozen=True)
class GenerateRequest:
    """One request: ``rid`` (unique among the engine's live requests; a str or an int),
    its prompt's token ids, and how to sample."""

    rid: str | int
    prompt: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if isinstance(self.rid, bool) or not isinstance(self.rid, str | int):
            raise BadSampling(
                f"a request id must be a str or an int, got {type(self.rid).__name__}"
            )
        object.__setattr__(self, "prompt", check_prompt(self.prompt))
        if not isinstance(self.sampling, SamplingParams):
            raise BadSampling("sampling must be SamplingParams")


@dataclass(frozen=True)
class TokenOut:
    """The ``index``-th generated token of ``rid`` (0 is the first)."""

    rid: str | int
    index: int
    token: int


@dataclass(frozen=True)
class Finished:
    """``rid`` is done: every token it generated, why it stopped (``FINISH_REASONS``),
    its prompt's length and how many of those tokens came from the cache at its first
    admission, the prefill tokens the ranks computed for it over all its admissions (a
    request never preempted or re-run computes ``prompt_tokens - cached_tokens``), and
    how often it was preempted or re-prefilled after a group recovery."""

    rid: str | int
    tokens: tuple[int, ...]
    reason: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    preemptions: int = 0
    recoveries: int = 0


@dataclass(frozen=True)
class Failed:
    """``rid`` ended without finishing: ``error`` is the typed error (its ``retryable``
    attribute, where present, says whether sending it again may succeed). The tokens
    sent before stay valid."""

    rid: str | int
    error: TpcacheError


GenEvent = TokenOut | Finished | Failed
