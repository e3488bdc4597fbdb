"""One completion request's engine requests: submitted together, one per prompt (one
choice each), their events gathered from the engine thread through a queue and turned
into choice updates by the thread serving the HTTP request.

Request ids are ``openai-<32 hex>-<choice>``, fresh per HTTP request: the engine's ids
are shared with its other frontends, and a random id can be neither guessed nor
cancelled by another client.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpcache.engine.requests import (
    BadSampling,
    Failed,
    Finished,
    GenerateRequest,
    GenEvent,
    SamplingParams,
    TokenOut,
)
from tpcache.frontend.openai_records import ApiError, sampling_error
from tpcache.frontend.openai_text import ChoiceText, TextCodec


def engine_error(exc: BaseException, rid: str | None = None, index: int = 0) -> ApiError:
    """What the client is told of an engine error (from ``submit`` or a ``Failed``) about
    its ``index``-th prompt, which the engine knows as ``rid`` (an id of the server's own:
    the message names the prompt instead)."""
    text = str(exc) if rid is None else str(exc).replace(f"request {rid!r}", f"prompt {index}")
    if isinstance(exc, BadSampling):
        return sampling_error(BadSampling(text))
    if getattr(exc, "retryable", False):  # EngineClosed, GenerationFailed, a recovering group
        return ApiError(503, f"the server cannot take this request now, try again: {text}", code="unavailable", kind="server_error")  # fmt: skip
    if isinstance(exc, ValueError):  # too large for the cache, out of the vocabulary
        return ApiError(400, text, param="prompt")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {text}", kind="server_error")


@dataclass
class Choice:
    """One prompt's progress (owned by the serving thread)."""

    index: int
    rid: str
    prompt_tokens: int
    text: ChoiceText
    cached_tokens: int = 0
    finish_reason: str | None = None  # set when the choice has ended
    sent_tokens: int = 0  # of text.tokens, already in an update


@dataclass(frozen=True)
class Update:
    """What one choice gained since its last update: text, token ids, and its finish
    reason if it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class CompletionRun:
    """The engine side of one HTTP completion request. ``submit`` first; then ``updates``
    until ``done``; ``cancel`` on any way out that is not ``done``."""

    engine: Any  # tpcache.engine.Engine: submit, cancel
    prompts: list[tuple[int, ...]]
    sampling: SamplingParams
    codec: TextCodec | None
    stops: tuple[str, ...] = ()
    choices: list[Choice] = field(default_factory=list)
    events: queue.SimpleQueue[tuple[int, GenEvent]] = field(default_factory=queue.SimpleQueue)

    def submit(self) -> None:
        """Submit every prompt; on a refusal cancel those already submitted and raise its
        ``ApiError``."""
        tag = uuid.uuid4().hex
        for i, prompt in enumerate(self.prompts):
            rid = f"openai-{tag}-{i}"
            try:
                req = GenerateRequest(rid, prompt, self.sampling)
                self.engine.submit(req, self._sink(i))
            except Exception as exc:
                self.cancel()
                raise engine_error(exc, rid, i) from None
            self.choices.append(Choice(i, rid, len(prompt), ChoiceText(self.codec, self.stops)))

    def _sink(self, index: int) -> Callable[[GenEvent], None]:
        put = self.events.put  # SimpleQueue.put never blocks the engine thread

        def sink(event: GenEvent) -> None:
            put((index, event))

        return sink

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def cancel(self) -> None:
        """Cancel every choice that has not ended (the client went away, or the server
        closes)."""
        for c in self.choices:
            if c.finish_reason is None:
                self.engine.cancel(c.rid)
                c.finish_reason = "cancelled"

    def updates(self, wait_s: float) -> list[Update] | None:
        """The choices' updates from the events that came within ``wait_s`` (None if
        none came). Raises ``ApiError`` for a request that failed (the others are
        cancelled)."""
        try:
            first = self.events.get(timeout=wait_s)
        except queue.Empty:
            return None
        touched: dict[int, Choice] = {}
        batch = [first]
        while True:
            try:
                batch.append(self.events.get_nowait())
            except queue.Empty:
                break
        for index, event in batch:
            c = self.choices[index]
            if c.finish_reason is None:
                self._apply(c, event)
                touched[index] = c
        return [self._update(c) for _, c in sorted(touched.items())]

    def _apply(self, c: Choice, event: GenEvent) -> None:
        if isinstance(event, TokenOut):
            c.text.push(event.token)
        elif isinstance(event, Finished):
            for t in event.tokens[len(c.text.tokens) :]:  # none, if every TokenOut came
                c.text.push(t)
            c.prompt_tokens, c.cached_tokens = event.prompt_tokens, event.cached_tokens
            c.finish_reason = event.reason if not c.text.stopped else "stop"
        elif isinstance(event, Failed):
            c.finish_reason = "error"
            self.cancel()
            raise engine_error(event.error, c.rid, c.index)
        if c.text.stopped and c.finish_reason is None:
            c.finish_reason = "stop"
            self.engine.cancel(c.rid)  # a stop string: the engine need not go on

    def _update(self, c: Choice) -> Update:
        text = c.text.finish() if c.finish_reason is not None else c.text.take()
        new = c.text.tokens[c.sent_tokens :]
        c.sent_tokens = len(c.text.tokens)
        return Update(c.index, text, new, c.finish_reason)

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens) over every choice."""
        return (
            sum(c.prompt_tokens for c in self.choices),
            sum(len(c.text.tokens) for c in self.choices),
            sum(c.cached_tokens for c in self.choices),
        )
