"""Starting a TP group, serving it as a named Ray actor, and stopping it.

``start_group`` builds ranks + mirror + coordinator in the calling process.
``CoordinatorService`` is the same behind a named (optionally detached) Ray actor, so a
frontend on any node of the cluster reaches it with ``connect(name, namespace)``
(``ray_client``; importable from here too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray

from tpcache.coordinator.build import Endpoints, GroupConfig, build_coordinator
from tpcache.coordinator.core import Coordinator
from tpcache.coordinator.errors import CoordinatorUnavailable
from tpcache.coordinator.ranks import RayRanks
from tpcache.errors import TpcacheError
from tpcache.frontend import api
from tpcache.frontend.frontend import REJECTED, handle, handle_many
from tpcache.frontend.owners import Owner
from tpcache.frontend.ray_client import DEFAULT_NAMESPACE, RayClient, connect
from tpcache.frontend.ray_gen import RayGenerate
from tpcache.frontend.served import describe, find_served, stop_served
from tpcache.frontend.serving import ModelServing, ServeOptions
from tpcache.logs import LineBuffer, configure
from tpcache.workers.rank import RankWorker

__all__ = [
    "AlreadyServing",
    "CoordinatorService",
    "GroupConfig",
    "RayClient",
    "ServeOptions",
    "connect",
    "describe",
    "find_served",
    "serve",
    "start_group",
    "stop_served",
]


_T = TypeVar("_T")


class AlreadyServing(TpcacheError, RuntimeError):
    """A coordinator is served under that name and namespace already."""

    def __init__(self, name: str, namespace: str, what: str) -> None:
        super().__init__(
            f"a coordinator is already serving as {name!r} in namespace {namespace!r} ({what})"
        )
        self.name = name
        self.namespace = namespace


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
    Every entry point holds the coordinator's lock (``Coordinator.lock``). A failure is
    recovered on a thread of its own: meanwhile calls are answered at once with
    ``CoordinatorUnavailable``, and ``stats()`` answers too.

    When the group's ranks run a model (``config.runner``), the service builds and owns
    its serving engine; ``generate_start``/``generate_poll``/``generate_cancel`` serve
    it (``ray_gen``), and ``serving`` may add the network frontend and the OpenAI
    endpoint in this process (``serving.ModelServing``).

    ``log_level``: log tpcache's lines at this level on the actor's stderr (its Ray worker
    log, forwarded where the driver asked Ray to) and keep them for ``log_lines``, how
    ``tpcache serve`` prints them; None leaves this process's logging alone.
    """

    def __init__(
        self,
        config: GroupConfig,
        health_interval_s: float = 2.0,
        serving: ServeOptions | None = None,
        log_level: str | None = None,
    ) -> None:
        self.config = config
        self.log_buffer: LineBuffer | None = None  # this process's lines, when asked
        if log_level is not None:
            self.log_buffer = LineBuffer()
            configure(log_level, self.log_buffer)
        self.serving: ModelServing | None = None
        self.generate = RayGenerate(None)  # its engine's once the group runs a model
        self._stop = threading.Event()
        restarted = False
        with contextlib.suppress(Exception):  # not inside an actor: no restart to detect
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        # A group that cannot start the first time (a taken metrics port, a bad events
        # endpoint) is kept as its error, for ``serve`` to raise as itself and remove the
        # actor: raised here, Ray would report an ActorDiedError with it as text. After a
        # restart there is no ``serve`` waiting: it raises, and Ray restarts again.
        self.start_error: Exception | None = None
        try:
            self.coord = start_group(config)
            try:
                has_model = config.runner is not None
                self.serving = ModelServing(self.coord, serving or ServeOptions(), has_model)
                self.generate = self.serving.generate
            except BaseException:
                self.coord.close()
                raise
        except Exception as exc:
            if restarted:
                raise
            self.start_error = exc
            return
        # This actor's process lives for the group: what it holds now (Ray, torch, the
        # group's start-up) is left out of the collector's scans, as on the ranks
        # (RankWorker.serve_steps), so a full collection does not stall the steps.
        gc.freeze()
        self.coord.config = dataclasses.replace(self.coord.config, recover_in_background=True)
        if restarted:
            self.coord.restart_note = (
                f"the coordinator restarted at {time.strftime('%Y-%m-%d %H:%M:%S')}"
            )
        if health_interval_s > 0:
            threading.Thread(
                target=self._watch, args=(health_interval_s,), name="tpcache-health", daemon=True
            ).start()

    def log_lines(self, buffer: str, after: int) -> tuple[str, int, list[str], int]:
        """The log lines numbered ``after`` and later of the buffer ``buffer`` names (from
        the first when it is not this actor's: a restarted actor has a new one), as
        ``(this buffer's id, the next number, lines, how many were dropped unread)``."""
        if self.log_buffer is None:
            return "", 0, [], 0
        start = after if buffer == self.log_buffer.id else 0
        nxt, lines, missed = self.log_buffer.since(start)
        return self.log_buffer.id, nxt, lines, missed

    def failed_start(self) -> Exception | None:
        """Why the group did not start (None: it did)."""
        return self.start_error

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with contextlib.suppress(Exception):  # errors reach frontends
                self.coord.check_health()
            self.generate.sweep()

    # ---- generate (a model served; polled: ``ray_gen``) ---------------------------------
    def generate_start(self, data: bytes, session: bytes) -> bytes:
        """Submit an encoded ``GenerateCall``: an encoded ``OkReply`` or ``ErrorReply``
        (``NoModel`` when the group runs no model). Then ``generate_poll``."""
        return self.generate.start(data, _owner(session) or Owner(b""))

    def generate_poll(self, session: bytes, request_id: Any, wait_s: float) -> list[bytes]:
        return self.generate.poll(_owner(session) or Owner(b""), request_id, wait_s)

    def generate_cancel(self, session: bytes, request_id: Any) -> bytes:
        return self.generate.cancel(_owner(session) or Owner(b""), request_id)

    def endpoints(self) -> dict[str, str | None]:
        """Where this service's network frontend and HTTP endpoint listen (None: not)."""
        none: dict[str, str | None] = {"network": None, "http": None}
        return none if self.serving is None else self.serving.endpoints()

    def _locked(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, holding the lock (as every entry point does)."""
        with self.coord.lock:
            return fn(*args)

    def call(self, data: bytes, session: bytes | None = None) -> bytes:
        """One encoded call; ``session``: the calling client's id (``ray_client``), which
        scopes its request ids (``owners``); None: unscoped ids."""
        return self._locked(handle, self.coord, data, _owner(session))

    def calls(self, items: list[bytes], session: bytes | None = None) -> list[bytes]:
        return self._locked(handle_many, self.coord, items, _owner(session))

    def sync(self) -> None:
        self._locked(self.coord.sync)

    def flush(self) -> None:
        self._locked(self.coord.flush)

    def evict(self, num_tokens: int, swa_tokens: int = 0) -> tuple[int | None, bytes | None]:
        """``Coordinator.evict``, answered as ``(tokens evicted, None)`` or ``(None, an
        encoded ErrorReply)`` (``RayClient._op`` raises it as its type)."""
        return self._answer(lambda: int(self.coord.evict(num_tokens, swa_tokens)))

    def reset(self) -> tuple[None, bytes | None]:
        """``Coordinator.reset``, answered as ``evict`` is."""
        return self._answer(self.coord.reset)

    def _answer(self, fn: Callable[[], Any]) -> tuple[Any, bytes | None]:
        with self.coord.lock:
            try:
                return fn(), None
            except REJECTED as exc:  # a typed error, as the frontend answers it
                return None, api.encode(api.error_reply(exc))

    def rank_digests(self) -> list[int]:
        with self.coord.lock:
            self.coord.sync()
            return list(self.coord.ranks.call("digest"))

    def rank_pids(self) -> list[int]:
        with self.coord.lock:
            if self.coord.recovering:  # the ranks are being replaced
                raise CoordinatorUnavailable("the TP group is being recovered; retry shortly")
            return list(self.coord.ranks.call("pid"))

    def stats(self) -> dict[str, Any]:
        return self.coord.stats()

    def recover(self) -> None:
        """Rebuild the group now (by hand), and restart automatic recovery attempts."""
        self._locked(self.coord.recover)

    def stop_recovery(self) -> None:
        """Stop automatic recovery attempts; the group stays down until ``recover``."""
        self._locked(self.coord.stop_recovery)

    def shutdown(self) -> None:
        """Stop the health check, the ranks and the endpoints (the actor stays)."""
        self._stop.set()
        if self.serving is not None:
            self.serving.close()
        if self.start_error is None:
            self.coord.close()


def _owner(session: object) -> Owner | None:
    """A Ray client's session as the owner of its requests (None: unscoped)."""
    if session is None:
        return None
    if not isinstance(session, bytes) or not 8 <= len(session) <= 64:
        raise api.BadRequest("a session must be 8 to 64 bytes")
    return Owner(b"ray:" + session)


def serve(
    config: GroupConfig,
    name: str = "tpcache",
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = False,
    resources: dict[str, float] | None = None,
    replace: bool = False,
    serving: ServeOptions | None = None,
    log_level: str | None = None,
) -> Any:
    """Start the coordinator as a named actor in ``namespace``; returns its handle once
    its group is up (and with it, when its ranks run a model, its engine and the
    endpoints ``serving`` asks for). ``resources``: custom Ray resources the coordinator's actor asks
    for (to place it on a node that has them; ranks on that node are reached over IPC).
    ``log_level``: the actor logs at it (``CoordinatorService``).

    Raises ``AlreadyServing`` if the name is taken (``replace``: stop that coordinator
    first), and the group's own start-up error (``MetricsError``, ``EventConfigError``,
    ...) if it cannot start; no actor is left behind then.
    """
    old = find_served(name, namespace)
    if old is not None:
        if not replace:
            raise AlreadyServing(name, namespace, describe(old))
        stop_served(old, name, namespace)
    # Restarted by Ray if its process dies; it then starts a fresh group (empty cache).
    opts: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "num_cpus": 0,
        "max_restarts": -1,
        # Frontends' calls serialise on the service's lock; a generate poll holds a
        # thread for up to a second without it.
        "max_concurrency": 16,
    }
    if detached:
        opts["lifetime"] = "detached"
    if resources:
        opts["resources"] = dict(resources)
    try:
        actor = (
            ray.remote(CoordinatorService).options(**opts).remote(config, 2.0, serving, log_level)
        )
    except ValueError:  # taken since we looked (ActorAlreadyExistsError is a ValueError)
        raise AlreadyServing(name, namespace, "started by another process just now") from None
    error = ray.get(actor.failed_start.remote())  # waits until the group is up
    if error is not None:
        ray.kill(actor, no_restart=True)
        raise error
    return actor
