"""A client of the network frontend (``tpcache.frontend.netfront``) for routers and
engines that are not Ray drivers. Imports neither torch nor Ray.

    from tpcache.client import Client
    c = Client("tcp://127.0.0.1:5560")           # CURVE: curve_server_key=...; or token=...
    got = c.admit("req-1", prompt_ids)            # prefix_len, slots of the prompt
    c.extend("req-1", 1)                          # slots of one decode step
    with c.batch() as b:                          # several calls, one step, one round trip
        a = b.admit("req-2", other_ids)
        d = b.extend("req-1", 1)
    a.result().prefix_len, d.result().slots
    c.finish("req-1", output_ids)

Errors come back typed, as the coordinator raised them (``tpcache.frontend.api``,
``tpcache.cache.errors``); ``retryable`` says whether to try again.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Unpack

import zmq

from tpcache.frontend import api
from tpcache.workers.netsec import make_client


class Pending:
    """A call made inside ``Client.batch()``: its reply once the batch is sent."""

    def __init__(self) -> None:
        self._reply: api.Reply | None = None

    def result(self) -> api.Reply:
        """The reply; raises the call's typed error if it failed."""
        if self._reply is None:
            raise RuntimeError("the batch has not been sent yet")
        if isinstance(self._reply, api.ErrorReply):
            api.raise_reply_error(self._reply)
        return self._reply


class Batch:
    """Calls collected by ``Client.batch()``; the same methods, each returning a
    ``Pending``."""

    def __init__(self) -> None:
        self.calls: list[api.Call] = []
        self.pending: list[Pending] = []

    def _add(self, call: api.Call) -> Pending:
        self.calls.append(call)
        self.pending.append(Pending())
        return self.pending[-1]

    def admit(
        self,
        rid: Any,
        tokens,
        priority: int = 0,
        reserve: int = 0,
        **space: Unpack[api.NamespaceFields],
    ) -> Pending:
        """``space``: ``lora_id``, ``lora_name``, ``cache_salt`` (``api.AdmitCall``)."""
        return self._add(api.AdmitCall(rid, _ints(tokens), priority, reserve, **space))

    def extend(self, rid: Any, n: int) -> Pending:
        return self._add(api.ExtendCall(rid, n))

    def cache_unfinished(self, rid: Any, tokens) -> Pending:
        return self._add(api.CacheUnfinishedCall(rid, _ints(tokens)))

    def finish(self, rid: Any, output_tokens=()) -> Pending:
        return self._add(api.FinishCall(rid, _ints(output_tokens)))

    def abort(self, rid: Any) -> Pending:
        return self._add(api.AbortCall(rid))


class Client:
    """A DEALER socket to the network frontend at ``endpoint``. Not thread-safe: one per
    thread (they are cheap). ``timeout_s`` bounds each round trip: no reply in time is
    ``CoordinatorUnavailable`` (retryable)."""

    def __init__(
        self,
        endpoint: str,
        *,
        curve_server_key: str | None = None,
        curve_keypair: tuple[str, str] | None = None,
        token: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._token = (token or "").encode()
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "big"))
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            make_client(self._sock, curve_server_key, curve_keypair)
        self._sock.connect(endpoint)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls ----------------------------------------------------------------------------
    def send(self, calls: list[api.Call]) -> list[api.Reply]:
        """``calls`` as one request (one step); the replies, in order (errors as
        ``ErrorReply``, not raised)."""
        rid = (next(self._ids) % (1 << 64)).to_bytes(8, "big")
        self._sock.send_multipart([rid, self._token, api.encode_calls(calls)])
        while True:
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise api.CoordinatorUnavailable(
                    f"no reply from {self.endpoint} within {self.timeout_s:g}s"
                )
            got_id, body = self._sock.recv_multipart()
            if got_id == rid:  # an earlier request's late reply is dropped
                return api.decode_replies(body)

    def _one(self, call: api.Call) -> api.Reply:
        (reply,) = self.send([call])
        if isinstance(reply, api.ErrorReply):
            api.raise_reply_error(reply)
        return reply

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """Calls made on the yielded ``Batch`` go as one request when the block ends."""
        b = Batch()
        yield b
        if b.calls:
            for p, reply in zip(b.pending, self.send(b.calls), strict=True):
                p._reply = reply

    def admit(
        self,
        rid: Any,
        tokens,
        priority: int = 0,
        reserve: int = 0,
        **space: Unpack[api.NamespaceFields],
    ) -> api.AdmitReply:
        """Admit ``rid``; ``space``: its cache namespace as ``lora_id``, ``lora_name``,
        ``cache_salt`` (``api.AdmitCall``). Raises the coordinator's typed errors."""
        r = self._one(api.AdmitCall(rid, _ints(tokens), priority, reserve, **space))
        assert isinstance(r, api.AdmitReply)
        return r

    def extend(self, rid: Any, n: int) -> api.SlotsReply:
        r = self._one(api.ExtendCall(rid, n))
        assert isinstance(r, api.SlotsReply)
        return r

    def cache_unfinished(self, rid: Any, tokens) -> api.CachedReply:
        r = self._one(api.CacheUnfinishedCall(rid, _ints(tokens)))
        assert isinstance(r, api.CachedReply)
        return r

    def finish(self, rid: Any, output_tokens=()) -> api.CachedReply:
        r = self._one(api.FinishCall(rid, _ints(output_tokens)))
        assert isinstance(r, api.CachedReply)
        return r

    def abort(self, rid: Any) -> None:
        self._one(api.AbortCall(rid))

    def stats(self) -> dict[str, Any]:
        r = self._one(api.StatsCall())
        assert isinstance(r, api.StatsReply)
        return dict(r.stats)


def _ints(tokens) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else list(tokens)


__all__ = ["Batch", "Client", "Pending"]
