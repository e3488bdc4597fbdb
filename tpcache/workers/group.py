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

Two timeouts. ``join_timeout_s`` bounds joining: the rendezvous of ``init``, which waits
for the slowest rank's process to start (a Ray worker importing torch takes seconds, tens
of seconds on a loaded machine, and a replacement rank during recovery starts only after
the failure). ``timeout_s`` bounds each collective, so a hung peer is found fast. One
timeout cannot do both: ``init_process_group(timeout=)`` also becomes the default group's
collective timeout. So ``init`` joins the default group with ``join_timeout_s`` and then
makes ``dist.new_group(timeout=timeout_s)`` over all ranks, which every collective here
uses; it meets on the already formed group's store, in milliseconds. (torch's private
``_set_pg_timeout`` on the default group works on torch 2.13 too, but it is private and
its gloo path was broken in some releases, pytorch#165422; ``new_group(timeout=)`` is
public and has bounded gloo collectives since torch 1.0.)

How each timeout behaved under gloo (a late rank, a late master, a peer that never
enters, a dead peer) is written down in ``results/group_timings.md``. After any failure
the group is broken and every later call raises GroupError at once. NCCL differs: by
default its watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the process down on a
collective timeout instead of raising.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tpcache.workers.group_spec import (
    _I64_MAX,
    _I64_MIN,
    GroupError,
    GroupInputError,
    GroupSpec,
    check_seconds,
    i64_to_u64,
    loopback_only,
)

_T = TypeVar("_T")
_PG_METHODS = ("allreduce", "broadcast", "allgather", "barrier", "rank", "size", "name")


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


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` means nccl for a CUDA device when CUDA is available, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" and torch.cuda.is_available() else "gloo"


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
        self._pg = pg
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._device = device
        self._timeout_s = timeout_s
        self._where = where
        self._owns_default = owns_default  # destroy() tears down the default group too
        # Owned by this object; set once, by the first failure or by destroy().
        self._broken: str | None = None
        self._destroyed = False
        # Owned by this object: collectives entered so far (a step's cost is counted in them).
        self.collectives = 0

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
        # A ProcessGroup, or a backend made directly (ProcessGroupGloo is no subclass).
        if not all(callable(getattr(pg, m, None)) for m in _PG_METHODS):
            raise GroupInputError(f"attach needs a torch.distributed process group, got {pg!r}")
        check_seconds("timeout_s", timeout_s)
        backend = str(pg.name()).lower()
        if backend not in ("gloo", "nccl"):
            raise GroupInputError(f"attach supports gloo and nccl groups, got {backend!r}")
        if backend == "nccl":
            if device is None or device.type != "cuda":
                raise GroupInputError(f"an nccl group needs a CUDA device, got {device}")
            comm = device
        else:
            comm = torch.device("cpu")
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
        backend = resolve_backend(spec.backend, device)
        if backend == "nccl":
            if device.type != "cuda" or not torch.cuda.is_available():
                raise GroupError(f"nccl needs a CUDA device, got {device} ({spec.where})")
            comm_device = device
        else:
            comm_device = torch.device("cpu")
        if dist.is_initialized():
            raise GroupError(
                f"this process already has a process group ({spec.where}); "
                "hand its TP group to TPGroup.attach instead"
            )
        if backend == "nccl":
            torch.cuda.set_device(comm_device)
        try:
            local = loopback_only() if spec.store_path is not None else contextlib.nullcontext()
            with local:
                dist.init_process_group(
                    backend,
                    init_method=spec.init_method,
                    rank=spec.rank,
                    world_size=spec.world_size,
                    # Bounds the store rendezvous, and would bound the default group's
                    # collectives too: hence the second group below.
                    timeout=timedelta(seconds=spec.join_timeout_s),
                )
                # Every rank is in by now, so this meets at once; its timeout is the one
                # every collective here runs under.
                pg = dist.new_group(timeout=timedelta(seconds=spec.timeout_s))
        except Exception as exc:
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            raise GroupError(
                f"init of {backend} group failed for {spec.where} "
                f"(join timeout {spec.join_timeout_s:g}s): {_first_line(exc)}"
            ) from exc
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
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def broken(self) -> str | None:
        """Why the group can no longer be used, or None while it is healthy."""
        return self._broken

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
        xs = self._int_list("min_max", values)
        n = len(xs)
        t = self._tensor([n, ~n, *xs, *(~x for x in xs)])
        self._collective("min_max", lambda: self._all_reduce(t, dist.ReduceOp.MIN))
        out = self._unpack("min_max", t)
        return out[:n], [~x for x in out[n:]]

    def agree_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over ranks with no length header (see the module docstring):
        only for a list whose length every rank takes from the code, never from data.
        Collective; changes no state."""
        t = self._tensor(self._int_list("agree_min", values))
        self._collective("agree_min", lambda: self._all_reduce(t, dist.ReduceOp.MIN))
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
            pair = [_I64_MIN, _I64_MIN]
        else:
            (d,) = self._int_list("digest_range", [digest])
            pair = [d, ~d]
        t = self._tensor(pair)
        self._collective("digest_range", lambda: self._all_reduce(t, dist.ReduceOp.MIN))
        lo, low_not = t.tolist()
        if lo == _I64_MIN and low_not == _I64_MIN:
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
        if self._backend == "nccl":
            return self.digest_range(digest)
        if digest is None:
            v = 0
        else:
            (d,) = self._int_list("digest_check", [digest])
            v = _fold_pair(d)
        t = self._tensor([v])
        self._collective("digest_check", lambda: self._all_reduce(t, dist.ReduceOp.BAND))
        got = int(t.item())
        if not got & _FLAG:
            return None
        return got >> 31 & _M31, ~got & _M31  # AND and OR of the folds

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values``, indexed by rank (to name the odd rank). Collective."""
        xs = self._int_list("all_gather_ints", values)
        n = len(xs)
        mine = self._tensor([n, *xs])
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective("all_gather_ints", lambda: self._pg.allgather([rows], [mine]).wait())
        out = [row.tolist() for row in rows]
        lens = [row[0] for row in out]
        if any(m != n for m in lens):
            raise self._fail("all_gather_ints", f"ranks passed lists of lengths {lens}")
        return [row[1:] for row in out]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank: its length (int64), then its bytes (uint8).

        Other ranks' ``data`` is ignored. If ``src`` has no valid payload (None, not
        bytes-like) it sends length -1, and every rank raises GroupError: the failure
        travels through the collective instead of leaving the peers to time out.
        """
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise GroupInputError(f"src={src!r} is outside [0, {self.world_size})")
        self._check_open("broadcast_bytes")
        payload: bytes | None = None
        if self.rank == src and isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        length = self._tensor([len(payload) if payload is not None else -1])
        self._collective("broadcast_bytes", lambda: self._broadcast(length, src))
        n = int(length.item())
        if n < 0:
            # The collective itself went well: the group stays usable.
            raise self._fail("broadcast_bytes", f"rank {src} had no bytes payload", broken=False)
        if n == 0:
            return b""
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self._device)
        self._collective("broadcast_bytes", lambda: self._broadcast(buf, src))
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
                f" ({self._where})"
            )
        self._check_open("all_reduce_sum")
        buf = (
            t if t.device == self._device and t.is_contiguous() else t.to(self._device).contiguous()
        )
        self._collective("all_reduce_sum", lambda: self._all_reduce(buf, dist.ReduceOp.SUM))
        if buf is not t:
            t.copy_(buf)
        return t

    def barrier(self) -> None:
        """Wait until every rank reaches this barrier. Collective."""
        opts = dist.BarrierOptions()
        idx = self._device.index
        if self._backend == "nccl" and idx is not None:
            # NCCL wants the device named, or it guesses one from the rank and warns.
            opts.device_ids = [idx]
        self._collective("barrier", lambda: self._pg.barrier(opts).wait())

    def destroy(self) -> None:
        """Leave the group (an attached group is its owner's: it is only left unused).
        Idempotent; safe after a failure. Not a collective."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._broken is None:
            self._broken = "destroyed"
        self._pg = None  # an attached group lives on with its owner
        if self._owns_default and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                raise GroupError(f"destroy failed for {self._where}: {exc}") from exc

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._pg.allreduce([t], opts).wait()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([t], opts).wait()

    def _reduce_min(self, op: str, values: Sequence[int], *, negate: bool) -> list[int]:
        xs = self._int_list(op, values)
        n = len(xs)
        body = [~x for x in xs] if negate else xs
        # The [n, ~n] header: after MIN it gives the shortest and the longest list.
        t = self._tensor([n, ~n, *body])
        self._collective(op, lambda: self._all_reduce(t, dist.ReduceOp.MIN))
        out = self._unpack(op, t)
        return [~x for x in out] if negate else out

    def _unpack(self, op: str, t: torch.Tensor) -> list[int]:
        """Check the [n, ~n] header of a MIN-reduced tensor; return the body."""
        vals = t.tolist()
        lo, hi = vals[0], ~vals[1]
        if lo != hi:
            raise self._fail(op, f"ranks passed lists of different lengths ({lo} to {hi})")
        return vals[2:]

    def _int_list(self, op: str, values: Sequence[int]) -> list[int]:
        self._check_open(op)
        xs: list[int] = []
        for v in values:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise GroupInputError(f"{op}: {v!r} is not an int ({self._where})")
            x = v.__index__()
            if not _I64_MIN <= x <= _I64_MAX:
                raise GroupInputError(
                    f"{op}: {x} does not fit in int64; carry u64 with u64_to_i64 ({self._where})"
                )
            xs.append(x)
        if not xs:
            raise GroupInputError(f"{op}: empty list ({self._where})")
        return xs

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=self._device)

    def _check_open(self, op: str) -> None:
        if self._broken is not None:
            raise GroupError(f"{op}: group is unusable ({self._broken}) for {self._where}")

    def _collective(self, op: str, fn: Callable[[], _T]) -> _T:
        self._check_open(op)
        self.collectives += 1
        try:
            return fn()
        except Exception as exc:
            raise self._fail(op, _first_line(exc)) from exc

    def _fail(self, op: str, why: str, *, broken: bool = True) -> GroupError:
        if broken:
            self._broken = f"{op} failed: {why}"
        return GroupError(
            f"{op} failed for {self._where} ({self._backend}, timeout {self._timeout_s:g}s): {why}"
        )


def _first_line(exc: BaseException) -> str:
    # torch's distributed errors carry a C++ stack trace after the first line.
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
