"""Starting a TP group, serving it as a named Ray actor, and connecting frontends to it.

``start_group`` builds ranks + mirror + coordinator in the calling process.
``CoordinatorService`` is the same behind a named (optionally detached) Ray actor, so a
frontend on any node of the cluster reaches it with ``connect(name, namespace)``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from tpcache.cache.keys import TokenLike
from tpcache.coordinator import api
from tpcache.coordinator.api import CoordinatorUnavailable
from tpcache.coordinator.build import Endpoints, GroupConfig, build_coordinator
from tpcache.coordinator.core import Admission, Coordinator
from tpcache.coordinator.frontend import handle, handle_many
from tpcache.coordinator.ranks import RayRanks
from tpcache.workers.rank import RankWorker

__all__ = ["Client", "CoordinatorService", "GroupConfig", "connect", "serve", "start_group"]

DEFAULT_NAMESPACE = "tpcache"


def start_group(config: GroupConfig, worker_cls: type[RankWorker] = RankWorker) -> Coordinator:
    """Start ``config.tp`` rank actors, agree the capacity, and return their coordinator,
    publishing KV events and serving metrics if configured.

    Needs ``ray.init`` first. ``coordinator.close()`` stops the ranks and the endpoints.
    Raises ``EventConfigError``/``EventPublisherError`` for a bad events endpoint before
    any rank starts.
    """
    ends = Endpoints(config)
    try:
        ranks = RayRanks(
            config.worker_spec(),
            use_gpus=config.use_gpus,
            strategy=config.strategy,
            worker_cls=worker_cls,
            transport=config.transport,
            rank_resources=[config.resources_of(r) for r in range(config.tp)],
            gpus_per_rank=config.gpus_per_rank,
        )
    except BaseException:
        ends.close()
        raise
    return build_coordinator(config, ranks, ranks.capacity, ends)


class CoordinatorService:
    """The coordinator behind a Ray actor (plain class; ``ray.remote`` is applied in
    ``serve``). Frontends call ``call``/``calls`` with encoded ``api`` messages.

    A background thread checks the ranks' health every ``health_interval_s`` so a rank
    that dies while the group is idle is noticed (and replaced) within a few seconds.
    Every entry point holds one lock: the coordinator itself is single-threaded.
    """

    def __init__(self, config: GroupConfig, health_interval_s: float = 2.0) -> None:
        self.config = config
        self.coord = start_group(config)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        with contextlib.suppress(Exception):  # not inside an actor: no restart to detect
            if ray.get_runtime_context().was_current_actor_reconstructed:
                self.coord.restart_note = (
                    f"the coordinator restarted at {time.strftime('%Y-%m-%d %H:%M:%S')}"
                )
        if health_interval_s > 0:
            threading.Thread(
                target=self._watch, args=(health_interval_s,), name="tpcache-health", daemon=True
            ).start()

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock, contextlib.suppress(Exception):  # errors reach frontends
                self.coord.check_health()

    def call(self, data: bytes) -> bytes:
        with self._lock:
            return handle(self.coord, data)

    def calls(self, items: list[bytes]) -> list[bytes]:
        with self._lock:
            return handle_many(self.coord, items)

    def sync(self) -> None:
        with self._lock:
            self.coord.sync()

    def rank_digests(self) -> list[int]:
        with self._lock:
            self.coord.sync()
            return list(self.coord.ranks.call("digest"))

    def rank_pids(self) -> list[int]:
        with self._lock:
            return list(self.coord.ranks.call("pid"))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.coord.stats()

    def recover(self) -> None:
        """Rebuild the group now (by hand), and restart automatic recovery attempts."""
        with self._lock:
            self.coord.recover()

    def stop_recovery(self) -> None:
        """Stop automatic recovery attempts; the group stays down until ``recover``."""
        with self._lock:
            self.coord.stop_recovery()

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            self.coord.close()


def serve(
    config: GroupConfig,
    name: str = "tpcache",
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = False,
    resources: dict[str, float] | None = None,
) -> Any:
    """Start the coordinator as a named actor in ``namespace``; returns its handle.
    ``resources``: custom Ray resources the coordinator's actor asks for (to place it on
    a node that has them; ranks on that node are reached over IPC)."""
    # Restarted by Ray if its process dies; it then starts a fresh group (empty cache).
    opts: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "num_cpus": 0,
        "max_restarts": -1,
        "max_concurrency": 4,  # frontends' calls serialise on the service's lock
    }
    if detached:
        opts["lifetime"] = "detached"
    if resources:
        opts["resources"] = dict(resources)
    actor = ray.remote(CoordinatorService).options(**opts).remote(config)
    ray.get(actor.stats.remote())  # wait until the group is up (raises if it failed)
    return actor


class Client:
    """A frontend's handle on a served coordinator: the same calls as ``Coordinator``,
    over encoded messages; errors come back as the same typed exceptions.

    While the coordinator's actor restarts (its process died; Ray starts it again), Ray
    answers with its own errors: they become ``CoordinatorUnavailable`` (retryable). Calls
    that change nothing (``stats``, ``sync``) are retried here for up to
    ``retry_s``; the others are not, since a call cut off by the restart may or may not
    have been applied (after a restart, its requests are lost anyway).
    """

    def __init__(self, actor: Any, retry_s: float = 30.0) -> None:
        self.actor = actor
        self.retry_s = retry_s

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

    def _call(self, call: api.Call) -> api.Reply:
        reply = api.decode_reply(self._get(self.actor.call.remote(api.encode(call))))
        if isinstance(reply, api.ErrorReply):
            api.raise_reply_error(reply)
        return reply

    def admit(
        self, request_id: Any, tokens: TokenLike, priority: int = 0, reserve: int = 0
    ) -> Admission:
        r = self._call(api.AdmitCall(request_id, _ints(tokens), priority, reserve))
        assert isinstance(r, api.AdmitReply)
        slots = np.asarray(r.slots, dtype=np.int64)
        return Admission(r.prefix_len, slots, slots.size, 1)

    def extend(self, request_id: Any, n: int) -> np.ndarray:
        r = self._call(api.ExtendCall(request_id, n))
        assert isinstance(r, api.SlotsReply)
        return np.asarray(r.slots, dtype=np.int64)

    def cache_unfinished(self, request_id: Any, tokens: TokenLike) -> int:
        r = self._call(api.CacheUnfinishedCall(request_id, _ints(tokens)))
        assert isinstance(r, api.CachedReply)
        return r.cached_tokens

    def finish(self, request_id: Any, output_tokens: TokenLike = ()) -> int:
        r = self._call(api.FinishCall(request_id, _ints(output_tokens)))
        assert isinstance(r, api.CachedReply)
        return r.cached_tokens

    def abort(self, request_id: Any) -> None:
        self._call(api.AbortCall(request_id))

    def stats(self) -> dict[str, Any]:
        data = self._retried("call", api.encode(api.StatsCall()))
        reply = api.decode_reply(data)
        if isinstance(reply, api.ErrorReply):
            api.raise_reply_error(reply)
        assert isinstance(reply, api.StatsReply)
        return dict(reply.stats)

    def sync(self) -> None:
        self._retried("sync")

    def recover(self) -> None:
        """Rebuild the group now, and restart automatic recovery attempts."""
        self._get(self.actor.recover.remote())

    def stop_recovery(self) -> None:
        """Stop automatic recovery attempts (the group stays down until ``recover``)."""
        self._get(self.actor.stop_recovery.remote())


def _ints(tokens: TokenLike) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    return np.asarray(tokens).tolist()


def connect(name: str = "tpcache", namespace: str = DEFAULT_NAMESPACE) -> Client:
    """A client for the coordinator served as ``name`` in ``namespace`` (any node)."""
    return Client(ray.get_actor(name, namespace=namespace))
