"""The request calls every client offers (admit, extend, cache_unfinished, finish, abort),
written once: each builds its ``api`` record and hands it to the client's ``_send`` with
the reply type it expects (``ReplyCalls``: the records both clients return). The Ray
client, the network client and their batches differ only in ``_send``: one round trip,
or a ``Pending`` kept until the batch goes. ``generate`` and ``cancel`` are written once
too (``GenerateCalls``), over the client's ``_open``: a generate call's replies as they
come.

Imports only ``api`` and numpy (no torch, no Ray): the torch-free client uses it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, Unpack

import numpy as np

from tpcache.errors import TpcacheError
from tpcache.frontend import api

A = TypeVar("A")  # what admit returns
S = TypeVar("S")  # what extend returns
C = TypeVar("C")  # what cache_unfinished and finish return
Z = TypeVar("Z")  # what abort returns


class UnexpectedReply(TpcacheError, RuntimeError):
    """The server answered a call with a reply of another kind (a server of another
    version, or a bug): nothing of it is used."""


class BatchNotSent(TpcacheError, RuntimeError):
    """A batched call's result was asked for before its ``batch()`` block ended."""


class RequestCalls(Generic[A, S, C, Z]):
    """The request calls over ``_send(call, reply_type)``; tokens may be any sequence or
    array of ints."""

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Any:
        """Deliver ``call``; ``reply_type``: the reply it gets when it succeeds (None:
        nothing is returned)."""
        raise NotImplementedError

    def admit(
        self,
        request_id: Any,
        tokens: Any,
        priority: int = 0,
        reserve: int = 0,
        **space: Unpack[api.NamespaceFields],
    ) -> A:
        """Admit a request; ``space``: its cache namespace as ``lora_id``, ``lora_name``,
        ``cache_salt`` (``api.AdmitCall``). Raises the coordinator's typed errors."""
        call = api.AdmitCall(request_id, ints(tokens), priority, reserve, **space)
        return self._send(call, api.AdmitReply)

    def extend(self, request_id: Any, n: int) -> S:
        return self._send(api.ExtendCall(request_id, n), api.SlotsReply)

    def cache_unfinished(self, request_id: Any, tokens: Any) -> C:
        return self._send(api.CacheUnfinishedCall(request_id, ints(tokens)), api.CachedReply)

    def finish(self, request_id: Any, output_tokens: Any = ()) -> C:
        return self._send(api.FinishCall(request_id, ints(output_tokens)), api.CachedReply)

    def abort(self, request_id: Any) -> Z:
        return self._send(api.AbortCall(request_id), None)


class ReplyCalls(RequestCalls[api.AdmitReply, api.SlotsReply, api.CachedReply, None]):
    """The request calls as every client returns them, whatever its transport: the
    ``api`` reply record of each (``admit`` an ``AdmitReply``, ``extend`` a
    ``SlotsReply``, ``cache_unfinished`` and ``finish`` a ``CachedReply``, ``abort``
    None), so code written against one client runs against the other."""


class Pending:
    """A call made inside a client's ``batch()``: its result once the batch is sent."""

    def __init__(self, convert: Callable[[api.Reply], Any]) -> None:
        self._convert = convert
        self._reply: api.Reply | None = None  # set by the client when the batch returns

    def result(self) -> Any:
        """What the same call outside a batch returns; raises its typed error if it
        failed, and ``RuntimeError`` while the batch has not been sent."""
        if self._reply is None:
            raise BatchNotSent("the batch has not been sent yet (its block has not ended)")
        return self._convert(self._reply)


class Batch(RequestCalls[Pending, Pending, Pending, Pending]):
    """The calls of one ``batch()`` block, each returning a ``Pending``; nothing is sent
    before the block ends. ``convert`` turns a successful reply into what the client's
    own call would return."""

    def __init__(self, convert: Callable[[api.Reply, type[api.Reply] | None], Any]) -> None:
        self.calls: list[api.Call] = []
        self.pending: list[Pending] = []
        self._convert = convert

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Pending:
        self.calls.append(call)
        self.pending.append(Pending(lambda r: self._convert(r, reply_type)))
        return self.pending[-1]

    def settle(self, replies: list[api.Reply]) -> None:
        """Hand each pending call its reply (in call order)."""
        for p, reply in zip(self.pending, replies, strict=True):
            p._reply = reply


def checked(reply: api.Reply, reply_type: type[api.Reply] | None) -> Any:
    """``reply`` if it is the kind its call gets (None for a call that returns nothing).
    Raises the call's typed error for an ``ErrorReply``, ``UnexpectedReply`` for a reply
    of another kind (a protocol error of the server)."""
    if isinstance(reply, api.ErrorReply):
        api.raise_reply_error(reply)
    if reply_type is None:
        return None
    if not isinstance(reply, reply_type):
        raise UnexpectedReply(
            f"expected a {reply_type.__name__}, the server sent a {type(reply).__name__}"
        )
    return reply


def ints(tokens: Any) -> list[int]:
    """Token ids as a list of Python ints, as the API's records take them (a list passes
    through; an array, a tuple or a range goes through numpy, so numpy ints become ints)."""
    if isinstance(tokens, list):
        return tokens
    return np.asarray(tokens).tolist()


class GenerateCalls:
    """``generate`` and ``cancel`` over the client's ``_open(call)`` (sends a generate
    call; an iterator of its replies as they come, ending after the last) and
    ``_send``."""

    def _open(self, call: api.GenerateCall) -> Iterator[api.Reply]:
        raise NotImplementedError

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Any:
        raise NotImplementedError

    def generate(
        self,
        prompt_token_ids: Any,
        max_new_tokens: int = 16,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Any = (),
        ignore_eos: bool = False,
        stream: bool = False,
        request_id: Any = None,
    ) -> Any:
        """Generate after ``prompt_token_ids`` on a server that serves a model
        (``engine.requests.SamplingParams`` says what the sampling arguments do).
        ``stream``: a ``TokenStream`` of the token ids as they are sampled (closing it
        early cancels the request); else the ``api.GeneratedReply`` once all are
        (tokens, finish_reason, prompt_tokens, cached_tokens). ``request_id``: this client's id
        for it (default: a random one), which ``cancel`` takes.

        Raises ``BadSampling`` here for an argument out of range, before anything is
        sent; the server's typed errors (``NoModel``, ``RequestTooLarge``,
        ``DuplicateRequest``, ``EngineClosed``, ...) when the answer is read: for a
        stream, from its first ``next``."""
        rid = request_id if request_id is not None else "gen-" + os.urandom(8).hex()
        call = api.GenerateCall(
            rid,
            ints(prompt_token_ids),
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            ints(stop_token_ids),
            ignore_eos,
            bool(stream),
        )
        call.as_request(rid)  # BadSampling before anything is sent
        replies = self._open(call)
        if stream:
            return TokenStream(self, rid, replies)
        done = False
        try:
            for reply in replies:
                if not isinstance(reply, api.TokensReply):
                    done = True
                    return checked(reply, api.GeneratedReply)
            raise UnexpectedReply("the server ended a generate call without its answer")
        finally:
            self._close(rid, replies, done)

    def _close(self, rid: Any, replies: Iterator[api.Reply], done: bool) -> None:
        """Stop reading ``rid``'s replies; cancel it unless its answer came."""
        close = getattr(replies, "close", None)
        if close is not None:
            close()
        if not done:
            # Best effort: the server (or this client's socket) may be gone too.
            with contextlib.suppress(Exception):
                self.cancel(rid)

    def cancel(self, request_id: Any) -> bool:
        """Stop a running generate call of this client; its slots come back and its
        answer ends with finish reason ``cancelled``. False if it was not running."""
        return self._send(api.CancelCall(request_id), api.CancelReply).cancelled


class TokenStream:
    """The token ids of a streamed generate call, as they are sampled; ``result`` holds
    its ``api.GeneratedReply`` once read to the end (which raises the call's typed
    error instead if it failed). ``close()`` (or leaving a ``with`` block) before the
    end cancels the request; so does an error while reading (a ``GenerateTimeout``).
    Close it or read it to the end: one dropped unread keeps running on the server
    until it ends."""

    def __init__(self, client: GenerateCalls, request_id: Any, replies: Iterator[api.Reply]):
        self.request_id = request_id
        self.result: api.GeneratedReply | None = None  # set when the last reply is read
        self._client = client
        self._replies = replies
        self._waiting: list[int] = []  # tokens of the last reply not yielded yet
        self._done = False  # the last reply was read, or the stream was closed

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._waiting:
            if self._done:
                raise StopIteration
            try:
                reply = next(self._replies)
            except StopIteration:
                self._done = True
                raise UnexpectedReply(
                    "the server ended a generate call without its answer"
                ) from None
            except BaseException:
                self.close()
                raise
            if isinstance(reply, api.TokensReply):
                self._waiting = list(reversed(reply.tokens))
                continue
            self._done = True
            self.result = checked(reply, api.GeneratedReply)
        return self._waiting.pop()

    def close(self) -> None:
        """Stop reading; cancel the request unless its answer came. Idempotent."""
        if self._done and self.result is not None:
            return
        done, self._done = self._done, True
        self._client._close(self.request_id, self._replies, done)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
