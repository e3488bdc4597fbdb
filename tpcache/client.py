"""A client of the network frontend (``tpcache.frontend.netfront``) for routers and
engines that are not Ray drivers. Imports neither torch nor Ray.

    from tpcache.client import NetworkClient
    c = NetworkClient("tcp://127.0.0.1:5560")    # CURVE: curve_server_key=...; or token=...
    got = c.admit("req-1", prompt_ids)            # prefix_len, slots of the prompt
    c.extend("req-1", 1)                          # slots of one decode step
    with c.batch() as b:                          # several calls, one step, one round trip
        a = b.admit("req-2", other_ids)
        d = b.extend("req-1", 1)
    a.result().prefix_len, d.result().slots
    c.finish("req-1", output_ids)

    # On a server that serves a model (`tpcache serve --model DIR --network-endpoint ...`):
    out = c.generate(prompt_ids, 32)              # out.tokens, out.finish_reason
    for token in c.generate(prompt_ids, 32, stream=True):   # tokens as they are sampled
        ...

Calls return the ``api`` reply records (``AdmitReply``, ``SlotsReply``, ``CachedReply``,
``GeneratedReply``), the same as the Ray client's (``tpcache.RayClient``). Errors come
back typed, as the coordinator raised them (``tpcache.frontend.api``,
``tpcache.cache.errors``); ``retryable`` says whether to try again. A call with no reply
in time raises ``OutcomeUnknown`` (it may have been applied): ``c.resend(err)`` asks
again without applying it twice.

Request ids are this client's own: another client's ids are unknown to it (each client
is its credential and its connection's random routing id).

Threads: a ``NetworkClient`` is used by one thread at a time; give each thread its own
(they are cheap). Within that thread, several generate streams may be open at once and
read in any order, between other calls: each message is kept for the call it answers.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

from tpcache.frontend import api
from tpcache.frontend.calls import (
    Batch,
    GenerateCalls,
    Pending,
    ReplyCalls,
    TokenStream,
    UnexpectedReply,
    checked,
)
from tpcache.transport.netsec import make_client


class NetworkClient(ReplyCalls, GenerateCalls):
    """A DEALER socket to the network frontend at ``endpoint``. Not thread-safe: one per
    thread (they are cheap). ``timeout_s`` bounds each round trip: no reply in time is
    ``OutcomeUnknown`` (see ``resend``); for a generate call, each wait for its next
    token (``GenerateTimeout``, and the call is cancelled).

    Its request ids are scoped to its ``session`` (its routing id; random unless given):
    another ``NetworkClient`` does not reach its requests. A router that restarts and
    must reach the requests it left running (to finish or abort them) passes the session
    it had (at least 16 bytes; keep it secret: it is the key to those requests)."""

    def __init__(
        self,
        endpoint: str,
        *,
        curve_server_key: str | None = None,
        curve_keypair: tuple[str, str] | None = None,
        token: str | None = None,
        timeout_s: float = 30.0,
        session: bytes | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._token = (token or "").encode()
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "big"))
        # Replies that came for an open generate call while another call read the
        # socket, by message id (a call's own id is popped when it ends).
        self._streams: dict[bytes, collections.deque[api.Reply]] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # The server knows this client by its routing id (its requests are scoped to it):
        # random, so no other client can claim it, and kept across reconnects.
        self.session = b"c" + os.urandom(16) if session is None else _check_session(session)
        self._sock.setsockopt(zmq.ROUTING_ID, self.session)
        if curve_server_key is not None:
            make_client(self._sock, curve_server_key, curve_keypair)
        self._sock.connect(endpoint)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> NetworkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls ----------------------------------------------------------------------------
    def send(self, calls: list[api.Call]) -> list[api.Reply]:
        """``calls`` as one request (one step); the replies, in order (errors as
        ``ErrorReply``, not raised; a request refused whole gives each call its error).
        Raises ``OutcomeUnknown`` if no reply comes within ``timeout_s``."""
        rid = (next(self._ids) % (1 << 64)).to_bytes(8, "big")
        return self._exchange(rid, api.encode_calls(calls), len(calls))

    def resend(self, err: api.OutcomeUnknown) -> list[api.Reply]:
        """The replies to the request ``err`` gave no reply for: sent again as the same
        request, which the server applies only if it never got it, and answers from
        memory otherwise (for its last few thousand requests). Raises ``OutcomeUnknown``
        again if there is still no reply."""
        if not isinstance(err, api.OutcomeUnknown) or not err.body:
            raise api.BadRequest("resend takes the OutcomeUnknown a call of this client raised")
        n = len(api.decode_calls(err.body, len(err.body)))
        return self._exchange(err.message_id, err.body, n)

    def _exchange(self, rid: bytes, body: bytes, n: int) -> list[api.Reply]:
        self._sock.send_multipart([rid, self._token, body])
        while True:
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise api.OutcomeUnknown(
                    f"no reply from {self.endpoint} within {self.timeout_s:g}s: the calls may "
                    "have been applied; resend() asks again without applying them twice",
                    rid,
                    body,
                )
            got_id, reply = self._sock.recv_multipart()
            if got_id in self._streams:  # an open generate call's
                self._streams[got_id].extend(api.decode_replies(reply))
            elif got_id == rid:  # an earlier request's late reply is dropped
                replies = api.decode_replies(reply)
                if len(replies) == n:
                    return replies
                if len(replies) == 1 and isinstance(replies[0], api.ErrorReply):
                    return replies * n  # refused whole (a bad token, too large)
                raise UnexpectedReply(f"{len(replies)} replies to a request of {n} calls")

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Any:
        (reply,) = self.send([call])
        return checked(reply, reply_type)

    def _open(self, call: api.GenerateCall) -> Iterator[api.Reply]:
        rid = (next(self._ids) % (1 << 64)).to_bytes(8, "big")
        # Streamed on the wire even for a whole answer: ``timeout_s`` then bounds the wait
        # for the next token, not the whole generation, and the server finds a client
        # that left while it generates.
        wire = msgspec.structs.replace(call, stream=True)
        self._sock.send_multipart([rid, self._token, api.encode_calls([wire])])
        self._streams[rid] = collections.deque()
        return self._stream_replies(rid)

    def _stream_replies(self, rid: bytes) -> Iterator[api.Reply]:
        """The replies of the generate call sent as ``rid``, as they come; ends after
        the last (anything but a ``TokensReply``)."""
        kept = self._streams[rid]
        try:
            while True:
                while not kept:
                    if not self._sock.poll(int(self.timeout_s * 1000)):
                        raise api.GenerateTimeout(
                            f"no answer from {self.endpoint} within {self.timeout_s:g}s; "
                            "the request was cancelled"
                        )
                    got_id, body = self._sock.recv_multipart()
                    if got_id in self._streams:
                        self._streams[got_id].extend(api.decode_replies(body))
                reply = kept.popleft()
                yield reply
                if not isinstance(reply, api.TokensReply):
                    return
        finally:
            self._streams.pop(rid, None)

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """Calls made on the yielded ``Batch`` go as one request when the block ends."""
        b = Batch(checked)
        yield b
        if b.calls:
            b.settle(self.send(b.calls))

    def stats(self) -> dict[str, Any]:
        r = self._send(api.StatsCall(), api.StatsReply)
        return dict(r.stats)


def _check_session(session: object) -> bytes:
    if not isinstance(session, bytes) or not 16 <= len(session) <= 255:
        raise api.BadRequest("a client's session must be 16 to 255 bytes")
    if session[0] == 0:  # ZMQ's own routing ids start with a zero byte
        raise api.BadRequest("a client's session must not start with a zero byte")
    return session


__all__ = ["Batch", "NetworkClient", "Pending", "TokenStream"]
