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
from typing import Any

import zmq

from tpcache.frontend import api
from tpcache.frontend.calls import Batch, Pending, RequestCalls, checked
from tpcache.workers.netsec import make_client


class Client(RequestCalls[api.AdmitReply, api.SlotsReply, api.CachedReply, None]):
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

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Any:
        (reply,) = self.send([call])
        return checked(reply, reply_type)

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


__all__ = ["Batch", "Client", "Pending"]
