"""The host tier in the lockstep: each rank runs its copies, and the group agrees how many
are done.

Copies. Every rank's cache starts the same copies in the same order (they come from the
same ops), so the copy log numbers them identically everywhere. After each op a rank
hands the copies the op started to its ``CopyEngine`` (``RankCopies.submit``), which
runs them off the step path, one at a time in id order, between the rank's device pool
shard and its host pool shard. A rank's done count is a local fact.

Agreement. Which collectives a step enters depends only on its batch: the coordinator
puts a ``CopySync`` op into every step it closes while its mirror has copies that are
not known done. At that op every rank enters one MIN all-reduce of its engine's done
count (-1 if any of its copies failed, or if the rank failed earlier in the step); the
MIN is a completed prefix of the log on every rank, since each engine's done jobs are a
prefix. The agreed count changes no state there: it travels back in the step's result
(``StepResult.copies_done``), and the coordinator, when it checks that result, applies
``copies_done(n)`` to its mirror and logs a ``CopiesDone(n)`` op in the step it is
building, so every rank applies the change at that same point of the op log as the
mirror did. Why this way round and not the ranks applying the agreed count at the
``CopySync`` itself: the mirror builds later steps from its own state while earlier
ones are still in flight (pipelined steps), so it cannot know at ``CopySync`` time what
the ranks will agree; a ``CopiesDone`` that it logs itself puts the change at a point of
the log it knows. The cost is latency: a completion is known one collected step later,
and one small all-reduce per step while copies are pending. A forward that waits
(``Coordinator.wait_ready``) sends a ``CopySync`` that lets each rank wait up to 50 ms
for the copies it needs before the MIN, then the ``CopiesDone``: about 1.6 extra steps
and 8-11 ms per request on TP=2 rank threads on 2 loaded CPU cores, where the copies
themselves take ~1 ms (``scripts/bench_host.py --lockstep 300``). The alternative,
draining the in-flight steps and applying the agreed count at the ``CopySync`` on the
ranks and the mirror alike, would stall the pipeline at every sync instead.

What waits for the agreement is only a forward that reads pages a load is bringing
back (``cache.host.ready_after``): the cache's own decisions never do, so a slow rank
holds back the group's forwards, never its state. A forward that writes pages a
write-back still reads waits on each rank for that rank's own engine alone
(``RankCopies.before_forward``, before the forward's agreed verdict): the copy and the
forward touch only that rank's shard, so no agreement is needed for it. A failed copy (on
any rank) makes the MIN -1: every rank fails that step
together, as for a failed op, and the coordinator recovers the group (an empty cache on
every rank, a fresh copy engine), so a half-copied page is never read and nothing leaks.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import TYPE_CHECKING

from tpcache.cache.errors import CacheError, HostTierError
from tpcache.cache.host.config import HostCopy
from tpcache.cache.keys import pages_to_slots
from tpcache.kv.host_copy import TO_DEVICE, TO_HOST, CopyEngine, CopyJob, host_pool
from tpcache.kv.pool import KVPool, device_budget_bytes, slots_that_fit
from tpcache.lockstep.ops import CopySync
from tpcache.model.context import ForwardError
from tpcache.workers.spec import WorkerSpec

if TYPE_CHECKING:
    import torch


class RankCopies:
    """One rank's host tier at run time: its host pool shard (``host_slots`` slots, the
    device pool's spec) and the engine that copies between it and ``device``. Owns the
    engine's thread: ``close`` stops it."""

    def __init__(self, device: KVPool, host_slots: int, page_size: int) -> None:
        self.host = host_pool(device, host_slots)
        self.engine = CopyEngine(device, self.host)
        self.page_size = page_size

    def submit(self, copies: list[HostCopy]) -> None:
        """Queue ``copies`` (page ids, from the cache's copy log, in id order)."""
        ps = self.page_size
        for c in copies:
            dev = pages_to_slots(c.device_pages, ps)
            host = pages_to_slots(c.host_pages, ps)
            if c.to_host:
                self.engine.submit(CopyJob(c.id, TO_HOST, dev, host))
            else:
                self.engine.submit(CopyJob(c.id, TO_DEVICE, host, dev))

    def local_done(self) -> int:
        """This rank's done count, or -1 if a copy failed here."""
        return self.engine.done_ok()

    def before_forward(self, host, rids: list, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until this rank's engine has done the copies
        that the forward of ``rids`` must not overtake here (``host``: the cache's host
        part; its ``local_after``: write-backs still reading pages the rows were given).
        A local wait: no rank waits for another. Raises ``ForwardError`` (for the
        forward's agreed verdict) if they are not done in time."""
        want = max(map(host.local_after, rids), default=0)
        if want and not self.engine.wait(want, timeout):
            raise ForwardError(
                f"this rank's copies reached {self.engine.done()} of the {want} the forward "
                f"waits for within {timeout:g}s"
            )

    def state(self, cache) -> list[int]:
        """Copies started (``cache``'s log), agreed done, and done by this engine."""
        host = cache.host
        return [host.counts()["copies_started"], host.copies_completed(), self.engine.done()]

    def drill(self, delay_s: float, fail: list[int]) -> None:
        """Fault drill: every later copy takes ``delay_s`` more; copies ``fail`` fail."""
        self.engine.delay_s = float(delay_s)
        self.engine.fail = set(fail)

    def close(self) -> None:
        """Stop the engine without running its queue (the rank's cache is being rebuilt:
        those copies' results are not wanted); a copy in hand finishes first. From then
        on ``local_done`` is -1 and ``submit`` raises ``CopyEngineClosed``, so a step that
        still holds these copies fails instead of agreeing a count that will never grow."""
        self.engine.close()


def sync_copies(group, copies: RankCopies | None, healthy: bool, op: CopySync) -> int:
    """A ``CopySync``'s one collective: MIN over ranks of each one's done count (-1 from
    a rank that is not ``healthy`` or whose copy failed), after waiting up to
    ``op.wait_s`` for ``op.want`` copies here (a local wait: no collective depends on
    it). A rank without a host tier sends 0."""
    if copies is not None and healthy and op.want:
        copies.engine.wait(op.want, op.wait_s)
    mine = copies.local_done() if copies is not None and healthy else (0 if healthy else -1)
    return group.agree_min([mine])[0]


def agree_pools(group, spec: WorkerSpec, device: torch.device) -> tuple[int, int | None]:
    """Start-up (collective, one MIN all-reduce): the device pool's capacity (the whole
    pages this rank's budget fits, at most ``spec.capacity_tokens``) and, with a host
    tier, the host pool's (the configured tokens in whole pages, less on a rank whose free
    memory holds fewer), agreed over the ranks. Returns (device tokens, host tokens or
    None). Raises ``HostTierError`` on every rank when the smallest rank cannot hold the
    configured host pool (the mirror is built with it, so it cannot shrink) and
    ``CacheError`` when the device pool holds less than a page; before anything is
    allocated."""
    ps = spec.cache.page_size
    budget = device_budget_bytes(device, spec.gpu_fraction, spec.cpu_budget_bytes)
    fit = slots_that_fit(spec.pool, budget)
    if spec.capacity_tokens is not None:
        fit = min(fit, spec.capacity_tokens)
    want = spec.cache.host_capacity_tokens
    room = 0
    if want is not None:  # (every rank has the same spec: all enter the gather or none)
        # Ranks on one machine share its free memory: each may count on its part only.
        share = _free_memory_bytes() // _ranks_on_this_machine(group)
        room = share // max(1, spec.pool.bytes_per_slot)
    device_tokens, host = group.all_min([fit // ps * ps, 0 if want is None else min(want, room)])
    if device_tokens < ps:
        raise CacheError(
            f"the KV pool holds {device_tokens} slots on the smallest rank, less than a page of {ps}"
        )
    if want is None:
        return device_tokens, None
    if host // ps * ps < want // ps * ps:
        raise HostTierError(
            f"the host pool holds {host // ps * ps} tokens on the smallest rank, "
            f"{want // ps * ps} configured"
        )
    return device_tokens, host // ps * ps


def _ranks_on_this_machine(group) -> int:
    """How many ranks of ``group`` run on this rank's kernel (collective: one gather)."""
    mine = _machine_key()
    return sum(1 for (key,) in group.all_gather_ints([mine]) if key == mine)


def _machine_key() -> int:
    # The kernel's boot id: ranks in containers on one host share it, and the memory.
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            ident = f.read().strip()
    except OSError:
        ident = socket.gethostname().encode()
    return int.from_bytes(hashlib.blake2b(ident, digest_size=7).digest(), "big")


def _free_memory_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not on this system: trust the configuration
        return 1 << 62


__all__ = ["RankCopies", "agree_pools", "sync_copies"]
