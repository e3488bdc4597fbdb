"""``RankSetup``: how one TP rank comes to hold its place in the group, its KV-pool shard
and its cache mirror: joining (or attaching to) the group, agreeing the pools, leaving.
What the rank then does per step, and the calls it serves, are ``rank.RankWorker``'s.
"""

from __future__ import annotations

import time

import torch

from tpcache.cache.protocol import Cache
from tpcache.errors import TpcacheError
from tpcache.group.join import first_line
from tpcache.group.spec import GroupError, GroupSpec, StoreDir, free_port, node_ip
from tpcache.group.tp_group import TPGroup
from tpcache.kv.pool import KVPool, rank_device
from tpcache.model.runner_spec import build_runner
from tpcache.workers.copysync import RankCopies, agree_pools
from tpcache.workers.model_host import ModelHost
from tpcache.workers.spec import WorkerSpec, WorkerSpecError


class RankNotReady(TpcacheError, RuntimeError):
    """A call that needs the rank set up (or in its group) came before it was."""


class RankSetup:
    """One TP rank's start-up and membership: process group + KV-pool shard + cache mirror.

    Call order: ``address`` (rank 0), ``join`` (all, concurrently), ``setup`` (all,
    concurrently: a collective). ``group``, ``pool`` and ``cache`` are None until then,
    and the accessors (``_cache``, ``_pool``, ``_group``) raise ``RankNotReady``. Every
    ``setup`` starts the steps over: ``last_step`` -1, ``failed`` None.

    With ``spec.runner`` the constructor builds that model runner and loads its shard of
    the weights (raising RunnerConfigError unless ``spec.pool`` is the pool its layout
    asks for).
    """

    def __init__(self, rank: int, spec: WorkerSpec, local_rank: int = 0) -> None:
        if not 0 <= rank < spec.pool.tp:
            raise WorkerSpecError(f"rank {rank} is outside [0, {spec.pool.tp})")
        self.rank = rank
        self.spec = spec
        self.device = rank_device(local_rank)
        self.group: TPGroup | None = None
        self.pool: KVPool | None = None
        self.cache: Cache | None = None
        self.last_step = -1
        # Why this rank can apply no more steps (a step failed here) until it starts over.
        self.failed: str | None = None
        # The model runner, its SWA pool and the forwards (workers/model_host.py). Owned here.
        self.models = ModelHost(rank, spec.pool.tp, self.device)
        if spec.runner is not None:
            runner = build_runner(spec.runner)
            self.models.install(runner, spec.pool, spec.cache.sliding_window)
        self._store = StoreDir()  # local_store's directory (rank 0 of one node)
        self._joining_since: float | None = None  # a join_and_setup in hand since then
        # Why this process can join no group again, or None. torch.distributed keeps
        # process-wide state (the counter its groups are named by, so the keys they meet
        # under in the store) that a failed join, or a failed leave, leaves advanced or
        # half torn down: a fresh peer then never meets this rank. Set here, never
        # cleared: only a new process starts clean.
        self.unfit: str | None = None

    # ---- start-up ---------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """Where the group's rendezvous can listen: this node's address and a free port."""
        return node_ip(), free_port()

    def local_store(self) -> str:
        """A rendezvous file for a group whose ranks all run on this node, in a new
        directory only this user can read (removed when this rank leaves the group)."""
        return self._store.new_store()

    def join(self, master_addr: str, master_port: int, store_path: str | None = None) -> str:
        """Join the TP process group (blocks until every rank joins, or ``join_timeout_s``).
        ``store_path``: every rank is on this node; meet through that file, over loopback.

        Raises GroupError if the group does not form; this process is then ``unfit`` for
        good, and a later join raises GroupError at once (rather than wait out the join
        timeout at a rendezvous its peers cannot complete with it)."""
        if self.unfit is not None:
            raise GroupError(
                f"rank {self.rank} cannot join a group again in this process: {self.unfit};"
                " a new process must take its place"
            )
        spec = GroupSpec(
            rank=self.rank,
            world_size=self.spec.pool.tp,
            master_addr=master_addr,
            master_port=master_port,
            backend=self.spec.backend,
            timeout_s=self.spec.timeout_s,
            join_timeout_s=self.spec.join_timeout_s,
            store_path=store_path,
        )
        try:
            self.group = TPGroup.init(spec, self.device)
        except Exception as exc:
            self.unfit = f"its join failed ({first_line(exc)})"
            raise
        return self.group.backend

    def setup(self) -> int:
        """Agree the pool capacity (MIN over ranks), allocate the pool, build the cache.

        Collective. Returns the agreed capacity in tokens (whole pages).
        """
        # The old pools go first: free memory is read below, and a host pool (or, on a
        # GPU, a device pool) still held would count against the new one, so a recovery
        # could refuse the pool its first start agreed.
        self._close_copies()
        self.pool = None
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        capacity, host = agree_pools(self._group(), self.spec, self.device)
        self.pool = KVPool(self.spec.pool, capacity, self.device)
        self.cache = self.spec.cache.build(capacity, rank=True)
        self.models.copies = (
            RankCopies(self.pool, host, self.spec.cache.page_size) if host is not None else None
        )
        self.last_step = -1
        self.failed = None
        return capacity

    def _close_copies(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.models.copies = None

    def attach(self, group: TPGroup) -> None:
        """Use ``group`` (``TPGroup.attach`` of a process group the caller owns) as this
        rank's TP group instead of joining one; leaves the current one first."""
        if group.world_size != self.spec.pool.tp or group.rank != self.rank:
            raise WorkerSpecError(
                f"rank {self.rank} of TP={self.spec.pool.tp} cannot use a group where it is "
                f"rank {group.rank} of {group.world_size}"
            )
        self.shutdown()
        self.group = group

    def attach_and_setup(self, group: TPGroup) -> int:
        """``attach`` then ``setup`` (collective): start, or start over with an empty cache
        and a fresh pool, on the caller's group."""
        self.attach(group)
        self.pool = None
        self.cache = None
        return self.setup()

    def join_and_setup(
        self, master_addr: str, master_port: int, store_path: str | None = None
    ) -> int:
        """``join`` then ``setup``: the whole start-up of a rank (collective)."""
        self._joining_since = time.monotonic()
        try:
            self.join(master_addr, master_port, store_path)
            return self.setup()
        finally:
            self._joining_since = None

    @property
    def copies(self) -> RankCopies | None:
        """The host tier's pool and copy engine (None without one), which forwards wait on."""
        return self.models.copies

    def shutdown(self) -> None:
        """Leave the process group (tolerates a broken one). Idempotent."""
        self._close_copies()
        self._leave_group()
        self._store.drop()

    def _leave_group(self) -> None:
        if self.group is not None:
            try:
                self.group.destroy()
            except Exception as exc:  # a broken group may not even tear down cleanly
                # What torch had of it may be half gone: no later join can trust it.
                self.unfit = self.unfit or f"leaving its group failed ({first_line(exc)})"
            self.group = None

    def _cache(self) -> Cache:
        if self.cache is None:
            raise RankNotReady(f"rank {self.rank} is not set up")
        return self.cache

    def _pool(self) -> KVPool:
        if self.pool is None:
            raise RankNotReady(f"rank {self.rank} is not set up")
        return self.pool

    def _group(self) -> TPGroup:
        if self.group is None:
            raise RankNotReady(f"rank {self.rank} has not joined its group")
        return self.group
