"""A frontend's handle on a coordinator served as a named Ray actor (``tpcache serve``,
``service.serve``), from any node of the cluster.

    import tpcache
    client = tpcache.connect("tpcache", "tpcache", address="HEAD_IP:6379")   # a RayClient
    got = client.admit("req-1", prompt_ids)       # got.prefix_len, got.slots
    with client.batch() as b:                     # several calls, one step
        a = b.admit("req-2", other_ids)
        b.extend("req-1", 1)
    a.result().prefix_len
    out = client.generate(prompt_ids, 32)         # with a model served: out.tokens
    for token in client.generate(prompt_ids, 32, stream=True):
        ...

Calls travel as encoded ``api`` messages and return the ``api`` reply records, as the
network client's (``tpcache.client.NetworkClient``) do; errors come back as the same
typed exceptions the coordinator raised.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from tpcache.coordinator.cluster import join
from tpcache.coordinator.errors import CoordinatorUnavailable
from tpcache.errors import TpcacheError
from tpcache.frontend import api
from tpcache.frontend.calls import Batch, GenerateCalls, ReplyCalls, checked

DEFAULT_NAMESPACE = "tpcache"


class NotServing(TpcacheError, ValueError):
    """No coordinator is served under that name and namespace on the cluster."""


class RayClient(ReplyCalls, GenerateCalls):
    """A frontend's handle on a served coordinator: the coordinator's calls over encoded
    messages, returning the ``api`` reply records (``admit`` an ``AdmitReply``, ``extend``
    a ``SlotsReply``, ``finish`` a ``CachedReply``: the network client's types); errors
    come back as the same typed exceptions. Thread-safe as far as the actor is: each call
    is one actor call. Its request ids are its own: another client's ids are unknown to
    it (``owners``).

    While the coordinator's actor restarts (its process died; Ray starts it again), Ray
    answers with its own errors: they become ``CoordinatorUnavailable`` (retryable). Calls
    that change nothing (``stats``, ``sync``, ``flush``) are retried here for up to
    ``retry_s``; the others are not, since a call cut off by the restart may or may not
    have been applied (after a restart, its requests are lost anyway).

    ``generate`` polls (``ray_gen``): one actor call starts it, then each poll waits up
    to ``poll_s`` for tokens and returns all that came.
    """

    poll_s = 0.5

    def __init__(self, actor: Any, retry_s: float = 30.0) -> None:
        self.actor = actor
        self.retry_s = retry_s
        # Scopes this client's request ids: another client's ids are unknown to it.
        self._session = os.urandom(16)

    # ---- transport -------------------------------------------------------------------------
    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except (ActorUnavailableError, RayActorError) as exc:
            raise CoordinatorUnavailable(
                f"the coordinator is unreachable (restarting or gone): {type(exc).__name__}"
            ) from None

    def _retried(self, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            try:
                return self._get(getattr(self.actor, method).remote(*args))
            except CoordinatorUnavailable:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _op(self, method: str, *args: Any) -> Any:
        """A service method that answers ``(value, encoded ErrorReply or None)``."""
        value, error = self._get(getattr(self.actor, method).remote(*args))
        if error is not None:
            api.raise_reply_error(api.decode_reply(error))
        return value

    def _send(self, call: api.Call, reply_type: type[api.Reply] | None) -> Any:
        data = self._get(self.actor.call.remote(api.encode(call), self._session))
        return checked(api.decode_reply(data), reply_type)

    def _open(self, call: api.GenerateCall) -> Iterator[api.Reply]:
        data = self._get(self.actor.generate_start.remote(api.encode(call), self._session))
        reply = api.decode_reply(data)
        if isinstance(reply, api.ErrorReply):
            return iter([reply])
        return self._polls(call.request_id)

    def _polls(self, request_id: Any) -> Iterator[api.Reply]:
        while True:
            ref = self.actor.generate_poll.remote(self._session, request_id, self.poll_s)
            for data in self._get(ref):
                reply = api.decode_reply(data)
                yield reply
                if not isinstance(reply, api.TokensReply):
                    return

    def cancel(self, request_id: Any) -> bool:
        data = self._get(self.actor.generate_cancel.remote(self._session, request_id))
        return checked(api.decode_reply(data), api.CancelReply).cancelled

    def endpoints(self) -> dict[str, str | None]:
        """Where the served group's network frontend and HTTP endpoint listen."""
        return dict(self._get(self.actor.endpoints.remote()))

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """The calls made on the yielded ``Batch`` go to the coordinator as one list when
        the block ends, and form one step; each ``Pending.result()`` then holds its
        answer or its error (a call the cache refuses fails alone; the others apply). If
        the block raises, nothing is sent. Raises ``CoordinatorUnavailable`` if the
        coordinator cannot be reached (the calls may or may not have been applied)."""
        b = Batch(checked)
        yield b
        if b.calls:
            items = [api.encode(c) for c in b.calls]
            replies = self._get(self.actor.calls.remote(items, self._session))
            b.settle([api.decode_reply(data) for data in replies])

    # ---- the whole cache -------------------------------------------------------------------
    def evict(self, num_tokens: int, swa_tokens: int = 0) -> int:
        """Evict at least ``num_tokens`` of full KV if that much is evictable (and, on a
        hybrid cache, ``swa_tokens`` of SWA KV); returns the full-KV tokens evicted.
        Raises ``CacheError`` for a bad count, nothing changed."""
        return self._op("evict", num_tokens, swa_tokens)

    def reset(self) -> None:
        """Drop every cached prefix and running request on every rank (running requests'
        later calls get ``UnknownRequest``)."""
        self._op("reset")

    def flush(self) -> None:
        """Send the steps the coordinator holds back for coalescing now (the health check
        sends them within ~2 s anyway)."""
        self._retried("flush")

    def sync(self) -> None:
        """Wait until every rank has applied and matched every step so far."""
        self._retried("sync")

    def stats(self) -> dict[str, Any]:
        data = self._retried("call", api.encode(api.StatsCall()))
        return dict(checked(api.decode_reply(data), api.StatsReply).stats)

    def recover(self) -> None:
        """Rebuild the group now, and restart automatic recovery attempts."""
        self._get(self.actor.recover.remote())

    def stop_recovery(self) -> None:
        """Stop automatic recovery attempts (the group stays down until ``recover``)."""
        self._get(self.actor.stop_recovery.remote())


def connect(
    name: str = "tpcache", namespace: str = DEFAULT_NAMESPACE, address: str | None = None
) -> RayClient:
    """A client for the coordinator served as ``name`` in ``namespace``, from any node.

    A process that is not a Ray driver yet joins first (``cluster.join``): ``address`` is
    the head's ``HOST:PORT`` (token authentication set up as needed), or by default
    ``RAY_ADDRESS``, else the cluster ``ray start`` made on this machine. Raises
    ``NotServing`` if nothing is served under that name, ``ClusterJoinError`` if the
    cluster cannot be joined."""
    joined = join(address or "auto")
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise NotServing(
            f"no coordinator named {name!r} in namespace {namespace!r} on the Ray cluster at "
            f"{joined.address} (start one with `tpcache serve --name {name} --namespace "
            f"{namespace}`)"
        ) from None
    return RayClient(actor)
