"""The TP ranks as Ray actors: the one place ``RankWorker`` is wrapped by Ray.

One placement-group bundle per rank: one GPU each when the cluster has GPUs, a sliver of
CPU otherwise (CPU ranks mostly wait on collectives; a whole CPU each would not fit
four ranks on a two-core machine), placed by the group's strategy (``PACK``, ``SPREAD``,
``STRICT_PACK``, ``STRICT_SPREAD``) and any custom resources per rank. Ranks may land on
several nodes; the process group meets at rank 0's node address (through a file, over
loopback, when they share one node).

Steps travel on the step channel (``transport="channel"``, the default; see
``step_path``), or, for comparison, as one Ray actor call per rank per message
(``transport="ray"``). Ray places, starts, restarts and names the ranks either way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpcache.coordinator.build import STRATEGIES, TRANSPORTS
from tpcache.coordinator.cluster import check_placeable
from tpcache.coordinator.errors import GroupConfigError, PlacementError
from tpcache.coordinator.rank_seen import actor_id, node_address, why_replace
from tpcache.coordinator.step_path import RAY_CALLS, ChannelPath
from tpcache.coordinator.step_types import RankCallError, first_cause
from tpcache.group.spec import node_ip
from tpcache.workers.rank import RankWorker
from tpcache.workers.spec import WorkerSpec

CPU_PER_RANK = 0.01
RankActor = ray.remote(RankWorker)
logger = logging.getLogger("tpcache.coordinator")


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


class RayRanks:
    """The ``RankTransport`` over Ray actors. Owns the actors and their placement group."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        use_gpus: bool | None = None,
        strategy: str = "PACK",
        worker_cls: type[RankWorker] = RankWorker,
        start_timeout_s: float = 120.0,
        transport: str = "channel",
        rank_resources: list[dict[str, float]] | None = None,
        gpus_per_rank: float = 1.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise GroupConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if strategy not in STRATEGIES:
            raise GroupConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        tp = spec.pool.tp
        self.world_size = tp
        self.peer_check = transport != "channel"  # the channel fails a lagging rank
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.transport = transport
        gpus = cluster_gpus() >= tp if use_gpus is None else use_gpus
        self.use_gpus = gpus
        self.gpus_per_rank = gpus_per_rank
        bundle = {"GPU": gpus_per_rank, "CPU": CPU_PER_RANK} if gpus else {"CPU": CPU_PER_RANK}
        bundles = [{**bundle, **(rank_resources[r] if rank_resources else {})} for r in range(tp)]
        self.path: ChannelPath | None = None
        self._joins: list[Any] = []  # the last group formation's calls, one per rank
        check_placeable(bundles)  # at once, where Ray would wait out the timeout
        self.pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=start_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise PlacementError(
                f"could not place {tp} ranks (bundles {bundles}, strategy {strategy}) within "
                f"{start_timeout_s:g}s; the cluster has {ray.cluster_resources()}"
            ) from None
        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        self.rank_nodes = [nodes[i] for i in range(tp)]  # Ray node id of each rank
        self.single_node = len(set(self.rank_nodes)) == 1
        self._actor_cls = RankActor if worker_cls is RankWorker else ray.remote(worker_cls)
        self.actors = [self._new_actor(i) for i in range(tp)]
        try:
            self.capacity = self._form_group("join_and_setup")
            self._open_path()
        except BaseException:
            self.close()
            raise
        self.replaced = 0  # ranks started to replace dead or hung ones, since creation
        self.last_replaced: list[int] = []  # the ranks the last restart() replaced
        if logger.isEnabledFor(logging.DEBUG):
            for r in range(tp):
                logger.debug("rank %d started: %s", r, self.where(r))

    def _open_path(self) -> None:
        """Start the step channel: IPC for ranks on this process's node, CURVE TCP for
        the others (``transport="channel"``)."""
        if self.transport != "channel":
            return
        here = ray.get_runtime_context().get_node_id()
        remote = {r for r, node in enumerate(self.rank_nodes) if node != here}
        timeout = self.start_timeout_s
        host = node_ip() if remote else ""
        self.path = ChannelPath(self.actors, remote, host, timeout, self.spec.timeout_s)

    def _close_path(self) -> None:
        if self.path is not None:
            self.path.close()
            self.path = None

    def _new_actor(self, rank: int) -> Any:
        return self._actor_cls.options(
            num_cpus=CPU_PER_RANK,
            num_gpus=self.gpus_per_rank if self.use_gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=rank
            ),
            # On the channel the loop is one long call; health checks and stop_steps run
            # beside it. On Ray calls, one thread keeps the steps in the order sent.
            max_concurrency=4 if self.transport == "channel" else 1,
        ).remote(rank, self.spec, 0)

    def _form_group(self, method: str) -> int:
        """Every rank (re)joins a new group and agrees the capacity: through a file on
        their node, over loopback, when all ranks share one node; else at rank 0's
        address (a TCP store, reachable from the other nodes)."""
        t = self.start_timeout_s
        if self.single_node:
            store = ray.get(self.actors[0].local_store.remote(), timeout=t)
            addr, port = "127.0.0.1", 1  # unused with a store file
        else:
            store = None
            addr, port = ray.get(self.actors[0].address.remote(), timeout=t)
        # Longer than the ranks' own bounds (a new rank's start-up, then the join, then
        # setup's one collective), so a failed join comes back as the rank's GroupError,
        # which names it, rather than as a bare timeout here.
        t += self.spec.join_timeout_s + self.spec.timeout_s
        self._joins = [getattr(a, method).remote(addr, port, store) for a in self.actors]
        caps = self._get(self._joins, t)
        self.master = (addr, port)
        return int(caps[0])

    # ---- RankTransport ------------------------------------------------------------------
    def send(self, steps: list[bytes]) -> Any:
        if self.path is not None:
            return self.path.send(steps, self.spec.timeout_s + 60.0)
        # A lone step goes as plain bytes: a list argument and result cost more per round
        # trip than one small step carries (results/group_timings.md).
        if len(steps) == 1:
            return False, [a.apply.remote(steps[0]) for a in self.actors]
        return True, [a.apply_steps.remote(steps) for a in self.actors]

    def ready(self, ticket: Any) -> bool:
        if self.path is not None:
            return self.path.ready(ticket)
        refs = ticket[1]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        return len(done) == len(refs)

    def collect(self, ticket: Any, timeout: float) -> list[list[bytes]]:
        if self.path is not None:
            return self.path.collect(ticket, timeout)
        many, refs = ticket
        per_rank = self._get(refs, timeout)
        if not many:
            return [per_rank]
        return [list(outs) for outs in zip(*per_rank, strict=True)]

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        """``RankWorker.<method>(*args)`` on every rank, in rank order: through the step
        channel (in order with the steps) unless it is one the actor answers itself."""
        if self.path is not None and method not in RAY_CALLS:
            return self.path.call(method, args, timeout)
        return self._get([getattr(a, method).remote(*args) for a in self.actors], timeout)

    def paths(self) -> list[str]:
        """How each rank's steps travel: ``ipc`` (on this node), ``tcp+curve`` (another
        node), or ``ray`` (actor calls, ``transport="ray"``); ``none`` while a channel
        group has no channel (a recovery that failed to rejoin it)."""
        if self.path is None:
            return ["ray" if self.transport == "ray" else "none"] * self.world_size
        return ["tcp+curve" if a.server_key else "ipc" for a in self.path.hub.attach]

    def call_on(self, rank: int, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """``RankWorker.<method>(*args)`` on ``rank`` alone (e.g. to plant a fault drill),
        in order with the steps; returns its value."""
        if not 0 <= rank < self.world_size:
            raise GroupConfigError(f"rank {rank} is outside [0, {self.world_size})")
        if self.path is not None and method not in RAY_CALLS:
            return self.path.call(method, args, timeout, only=rank)[rank]
        return self._get([getattr(self.actors[rank], method).remote(*args)], timeout)[0]

    def restart(self, probe_s: float = 2.0) -> int:
        """Replace every rank that is dead, does not answer within ``probe_s``, whose step
        loop has been busy with one message longer than ``probe_s`` (hung in a step: its
        peers' collectives timed out and they are idle again), that is still joining a
        group an earlier failed attempt formed, or whose join of that group failed; have
        all ranks form a new group and a new step channel, and agree the capacity again.
        The new ranks and the survivors all start with an empty cache. Returns the
        capacity. Raises what forming the new group raised (``RankCallError`` naming the
        rank that failed first); the next call replaces the ranks that failed in it."""
        self._close_path()
        unfit = self._unfit_joins()
        self._joins = []  # those ranks are replaced below; the others have none in hand
        refs = [a.health.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=probe_s)
        done = set(ready)
        self.last_replaced = []
        for rank, ref in enumerate(refs):
            seen = why_replace(rank, ref, ref in done, rank in unfit, probe_s)
            if seen is not None:
                logger.warning("replacing rank %d (%s): %s", rank, self.where(rank), seen)
                with contextlib.suppress(Exception):
                    ray.kill(self.actors[rank], no_restart=True)
                self.actors[rank] = self._new_actor(rank)
                self.replaced += 1
                self.last_replaced.append(rank)
        self.capacity = self._form_group("rejoin")
        self._open_path()
        return self.capacity

    def where(self, rank: int) -> str:
        """Where ``rank`` runs, for a log line: its Ray actor id and node address."""
        actor = self.actors[rank] if rank < len(self.actors) else None
        return f"actor {actor_id(actor)} on node {node_address(self.rank_nodes[rank])}"

    def _unfit_joins(self) -> set[int]:
        """The ranks whose call in the last group formation has not returned, or returned
        an error. Not returned: the call may not have started yet (a new actor still
        starting, its health answered first) and would then join the old group while the
        new one waits for it. An error: a failed join leaves torch's process-wide group
        state unusable for the next one (``RankWorker.unfit``), whatever the rank says."""
        joins = self._joins
        if not joins:
            return set()
        finished, _ = ray.wait(joins, num_returns=len(joins), timeout=0)
        returned = set(finished)
        unfit = set()
        for rank, ref in enumerate(joins):
            if ref not in returned:
                unfit.add(rank)
                continue
            try:
                ray.get(ref, timeout=0)
            except Exception:  # whatever failed: the join, setup, or the actor itself
                unfit.add(rank)
        return unfit

    # ---- life ---------------------------------------------------------------------------
    def close(self) -> None:
        self._close_path()
        with contextlib.suppress(Exception):  # a rank that is gone or hung: killed below
            # Each rank leaves its group and drops its rendezvous directory (a killed one
            # leaves it to the next group's sweep).
            ray.get([a.shutdown.remote() for a in getattr(self, "actors", [])], timeout=2.0)
        for a in getattr(self, "actors", []):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None

    def _get(self, refs: list[Any], timeout: float) -> list[Any]:
        """Results in rank order. The first failure to arrive raises ``RankCallError`` at
        once: a dead or failed rank is reported without waiting for a hung peer."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            # One wait for the whole group: ray.get returns early on the first error (a
            # failed or dead rank), so only then is each reply looked at to name the rank.
            return ray.get(refs, timeout=timeout)
        pending = list(refs)
        failures: list[RankCallError] = []
        while pending and not failures:
            left = deadline - time.monotonic()
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not done:
                rank = refs.index(pending[0])
                raise RankCallError(rank, TimeoutError(f"no reply within {timeout:g}s"))
            failures += _failures(refs, done)
        if failures:
            # Its peers raise together: a moment more lets the rank where it failed be named.
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            raise first_cause(failures + _failures(refs, done))
        return ray.get(refs)


def _failures(refs: list[Any], done: list[Any]) -> list[RankCallError]:
    """The failed ones of ``done`` (finished refs), as ``RankCallError`` naming the rank."""
    out = []
    for ref in done:
        rank = refs.index(ref)
        try:
            ray.get(ref, timeout=0)
        except RayActorError as exc:
            out.append(RankCallError(rank, exc, dead=True))
        except RayTaskError as exc:
            out.append(RankCallError(rank, getattr(exc, "cause", None) or exc))
        except Exception as exc:  # e.g. an error Ray could not carry back
            out.append(RankCallError(rank, exc))
    return out
