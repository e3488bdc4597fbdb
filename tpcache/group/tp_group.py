"""The TP process group of one rank: agreement collectives over ``torch.distributed``.

Contract for every collective here: every rank of the group calls it, in the same order,
with lists of the same length. A rank that skips one hangs its peers until the group's
timeout. A local failure should still enter the collective, carrying a sentinel value
(e.g. -1 through ``all_min``), so that every rank sees it. Unequal lengths are a protocol
bug that gloo answers inconsistently (a quiet wrong result, an error, or aborting the
process); a two-int64 length header turns the quiet case into a GroupError.

The lockstep path pays for every element instead: gloo's all-reduce splits its tensor
over the ranks, so its cost grows with the element count until there is one per rank
(figures in ``results/group_timings.md``). So the two collectives a step runs carry no
header: ``agree_min`` for lists whose length the code fixes (one per pool of the cache
kind every rank builds from the same spec), and ``digest_check``, which carries a failure
too: one element under gloo (a bitwise AND, which costs what a MIN of one does), two
under NCCL (``digest_range``), which has no bitwise reduction.

Unsigned 64-bit values (state digests, block hashes) travel as int64 with the same bits:
``u64_to_i64`` before, ``i64_to_u64`` after. The reinterpretation is a bijection, so the
MIN and the MAX of the carried values are equal iff every rank holds the same digest,
although signed order differs from unsigned order.

Joining (the rendezvous, its two timeouts) is ``group_join.py``'s part. How each timeout behaved under gloo (a late rank, a late master, a peer that never
enters, a dead peer) is written down in ``results/group_timings.md``. After any failure
the group is broken and every later call raises GroupError at once. NCCL differs: by
default its watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the process down on a
collective timeout instead of raising.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tpcache.group.join import attached_backend, join_default_group
from tpcache.group.spec import (
    I64_MIN,
    GroupError,
    GroupInputError,
    GroupSpec,
    i64_to_u64,
)
from tpcache.group.wire import Wire

_M31 = (1 << 31) - 1
_FLAG = 1 << 62  # set by every healthy rank in _fold_pair; a failed rank sends 0


def _fold_pair(digest: int) -> int:
    """A healthy rank's element for ``TPGroup.digest_check``: bit 62 set, bits 61-31 the
    31-bit fold ``f`` of the 64-bit ``digest``, bits 30-0 ``~f``. Under a bitwise AND over
    ranks the first field becomes the AND of the folds and the second the complement of
    their OR. Always a positive int64. ``digest`` is an int64 (``u64_to_i64``'s)."""
    u = i64_to_u64(digest)
    f = (u ^ (u >> 31) ^ (u >> 62)) & _M31
    return _FLAG | f << 31 | (~f & _M31)


class TPGroup:
    """One rank's handle on the TP group: a ``torch.distributed`` process group of all ranks.

    Either joined here (``TPGroup.init``: this process's default group plus a group with
    the collective timeout, see the module docstring) or an engine's own group handed in
    (``TPGroup.attach``: tpcache runs its collectives on it and leaves its life to the
    owner). Collectives call the group's own methods, so a group need not be registered
    with ``torch.distributed`` (one made directly, e.g. ``ProcessGroupGloo`` over a store
    for ranks that are threads of one process). The group's tensors live on ``device``:
    the rank's CUDA device for nccl, the CPU for gloo. After a failed collective the group
    is marked broken: later calls raise GroupError at once instead of waiting out another
    timeout.
    """

    def __init__(
        self,
        pg: Any,  # a dist.ProcessGroup, or a backend such as ProcessGroupGloo
        *,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        where: str,
        owns_default: bool = False,
    ) -> None:
        # Owned by this object: the group's one way to run a collective.
        self._wire = Wire(pg, backend=backend, device=device, timeout_s=timeout_s, where=where)
        self.rank = rank  # the group's identity: fixed for its life
        self.world_size = world_size
        self._owns_default = owns_default  # destroy() tears down the default group too
        self._destroyed = False

    @classmethod
    def attach(
        cls,
        pg: Any,
        *,
        device: torch.device | None = None,
        timeout_s: float = 60.0,
        where: str = "",
    ) -> TPGroup:
        """Use ``pg``, a process group the caller made and owns (an engine's TP group, or
        one over an in-process store), as the TP group. Its ranks are the group's own
        ranks; ``timeout_s`` is what the group was made with (for messages: the group
        enforces its own). ``destroy`` leaves ``pg`` alone. Raises GroupInputError for
        something that is not a process group, or nccl without a CUDA ``device``."""
        backend, comm = attached_backend(pg, device, timeout_s)
        rank, size = pg.rank(), pg.size()
        return cls(
            pg,
            rank=rank,
            world_size=size,
            backend=backend,
            device=comm,
            timeout_s=timeout_s,
            where=f"rank {rank}/{size} of an attached {backend} group{' ' + where if where else ''}",
        )

    @classmethod
    def init(cls, spec: GroupSpec, device: torch.device) -> TPGroup:
        """Join the group; blocks until all ``world_size`` ranks arrive.

        Raises GroupError if a rank does not arrive within about ``join_timeout_s`` (up to
        ~2.5x on a non-master rank, which retries connecting), if the port is taken, if
        nccl is asked for without a CUDA device, or if this process already has a group
        (an engine that has one passes its TP group to ``attach`` instead).
        Collectives on the returned group time out after ``timeout_s``.
        """
        pg, backend, comm_device = join_default_group(spec, device)
        return cls(
            pg,
            rank=spec.rank,
            world_size=spec.world_size,
            backend=backend,
            device=comm_device,
            timeout_s=spec.timeout_s,
            where=spec.where,
            owns_default=True,
        )

    @property
    def backend(self) -> str:
        return self._wire.backend

    @property
    def device(self) -> torch.device:
        return self._wire.device

    @property
    def broken(self) -> str | None:
        """Why the group can no longer be used, or None while it is healthy."""
        return self._wire.broken

    @property
    def collectives(self) -> int:
        """Collectives entered so far (a step's cost is counted in them)."""
        return self._wire.collectives

    def all_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over ranks, in one all-reduce. Collective; changes no state."""
        return self._reduce_min("all_min", values, negate=False)

    def all_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise MAX over ranks, in one all-reduce. Collective; changes no state."""
        return self._reduce_min("all_max", values, negate=True)

    def min_max(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Element-wise (MIN, MAX) over ranks, in one all-reduce MIN of ``values ++ ~values``.

        Bitwise NOT, not negation: ``~x`` reverses int64 order without the overflow of
        ``-INT64_MIN``, which is exactly the digest 0x8000000000000000. Collective.
        """
        xs = self._wire.ints("min_max", values)
        n = len(xs)
        t = self._wire.tensor([n, ~n, *xs, *(~x for x in xs)])
        self._wire.all_reduce("min_max", t, dist.ReduceOp.MIN)
        out = self._wire.unpack("min_max", t)
        return out[:n], [~x for x in out[n:]]

    def agree_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over ranks with no length header (see the module docstring):
        only for a list whose length every rank takes from the code, never from data.
        Collective; changes no state."""
        t = self._wire.tensor(self._wire.ints("agree_min", values))
        self._wire.all_reduce("agree_min", t, dist.ReduceOp.MIN)
        return t.tolist()

    def digest_range(self, digest: int | None) -> tuple[int, int] | None:
        """MIN and MAX over ranks of an int64 ``digest`` (``u64_to_i64`` of a state digest),
        in one all-reduce MIN of two elements; ``None`` from a rank that failed.

        A healthy rank sends ``[d, ~d]``, a failed one ``[INT64_MIN, INT64_MIN]``, a pair
        no healthy rank sends (``~d != d``). Returns ``None`` if any rank failed, else
        ``(min, max)``. The one ambiguous result: healthy digests spanning exactly
        INT64_MIN..INT64_MAX read as a failure, which is a lockstep error all the same.
        Collective.
        """
        if digest is None:
            pair = [I64_MIN, I64_MIN]
        else:
            (d,) = self._wire.ints("digest_range", [digest])
            pair = [d, ~d]
        t = self._wire.tensor(pair)
        self._wire.all_reduce("digest_range", t, dist.ReduceOp.MIN)
        lo, low_not = t.tolist()
        if lo == I64_MIN and low_not == I64_MIN:
            return None
        return lo, ~low_not

    def digest_check(self, digest: int | None) -> tuple[int, int] | None:
        """Whether every rank holds the same int64 ``digest``, in one all-reduce; ``None``
        from a rank that failed. Returns ``None`` if any rank failed, else a pair that is
        equal iff the ranks agree. Collective.

        NCCL: ``digest_range``, the MIN and MAX of the whole 64 bits. gloo: one element,
        because a second costs a step measurably (``results/group_timings.md``). NCCL
        has no bitwise reduction; gloo's BAND of ``_fold_pair`` gives the AND and the OR of
        a 31-bit fold of the digests (its pair: equal iff every rank's fold is the same).
        A failed rank sends 0, which clears the flag bit every healthy rank sets, so a
        failure never reads as a divergence nor the reverse. What a 31-bit fold gives
        up: a divergence that keeps the fold (chance 2**-31) passes this check, and then
        only the coordinator's comparison of each rank's whole digest with its mirror's
        catches it, at the same step.
        """
        if self._wire.backend == "nccl":
            return self.digest_range(digest)
        if digest is None:
            v = 0
        else:
            (d,) = self._wire.ints("digest_check", [digest])
            v = _fold_pair(d)
        t = self._wire.tensor([v])
        self._wire.all_reduce("digest_check", t, dist.ReduceOp.BAND)
        got = int(t.item())
        if not got & _FLAG:
            return None
        return got >> 31 & _M31, ~got & _M31  # AND and OR of the folds

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values``, indexed by rank (to name the odd rank). Collective."""
        xs = self._wire.ints("all_gather_ints", values)
        n = len(xs)
        mine = self._wire.tensor([n, *xs])
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wire.run("all_gather_ints", lambda: self._wire.pg.allgather([rows], [mine]).wait())
        out = [row.tolist() for row in rows]
        lens = [row[0] for row in out]
        if any(m != n for m in lens):
            raise self._wire.fail("all_gather_ints", f"ranks passed lists of lengths {lens}")
        return [row[1:] for row in out]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank: its length (int64), then its bytes (uint8).

        Other ranks' ``data`` is ignored. If ``src`` has no valid payload (None, not
        bytes-like) it sends length -1, and every rank raises GroupError: the failure
        travels through the collective instead of leaving the peers to time out.
        """
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise GroupInputError(f"src={src!r} is outside [0, {self.world_size})")
        self._wire.check_open("broadcast_bytes")
        payload: bytes | None = None
        if self.rank == src and isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        length = self._wire.tensor([len(payload) if payload is not None else -1])
        self._wire.broadcast("broadcast_bytes", length, src)
        n = int(length.item())
        if n < 0:
            # The collective itself went well: the group stays usable.
            raise self._wire.fail(
                "broadcast_bytes", f"rank {src} had no bytes payload", broken=False
            )
        if n == 0:
            return b""
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._wire.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self._wire.device)
        self._wire.broadcast("broadcast_bytes", buf, src)
        return buf.cpu().numpy().tobytes()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum the floating-point tensor ``t`` over ranks, in place; returns ``t``.

        Collective: every rank passes a tensor of the same shape and dtype (a mismatch is
        a protocol bug that the backend may not catch). A tensor off the group's device
        (a CUDA tensor under gloo) travels through the group's device and back. Every
        rank gets the same sum (the backend reduces once and shares the result).
        """
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise GroupInputError(
                f"all_reduce_sum needs a floating-point tensor, got {type(t).__name__}"
                f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}"
                f" ({self._wire.where})"
            )
        self._wire.check_open("all_reduce_sum")
        buf = (
            t
            if t.device == self._wire.device and t.is_contiguous()
            else t.to(self._wire.device).contiguous()
        )
        self._wire.all_reduce("all_reduce_sum", buf, dist.ReduceOp.SUM)
        if buf is not t:
            t.copy_(buf)
        return t

    def barrier(self) -> None:
        """Wait until every rank reaches this barrier. Collective."""
        opts = dist.BarrierOptions()
        idx = self._wire.device.index
        if self._wire.backend == "nccl" and idx is not None:
            # NCCL wants the device named, or it guesses one from the rank and warns.
            opts.device_ids = [idx]
        self._wire.run("barrier", lambda: self._wire.pg.barrier(opts).wait())

    def destroy(self) -> None:
        """Leave the group (an attached group is its owner's: it is only left unused).
        Idempotent; safe after a failure. Not a collective."""
        if self._destroyed:
            return
        self._destroyed = True
        self._wire.close()  # an attached group lives on with its owner
        if self._owns_default and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                raise GroupError(f"destroy failed for {self._wire.where}: {exc}") from exc

    def _reduce_min(self, op: str, values: Sequence[int], *, negate: bool) -> list[int]:
        xs = self._wire.ints(op, values)
        n = len(xs)
        body = [~x for x in xs] if negate else xs
        # The [n, ~n] header: after MIN it gives the shortest and the longest list.
        t = self._wire.tensor([n, ~n, *body])
        self._wire.all_reduce(op, t, dist.ReduceOp.MIN)
        out = self._wire.unpack(op, t)
        return [~x for x in out] if negate else out
