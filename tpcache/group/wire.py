"""``Wire``: the process group under one ``TPGroup``, and the one way its collectives run.

Every collective goes through ``run``, which refuses to start on a broken group, counts
it, and on any failure marks the group broken (so later calls raise GroupError at once
instead of waiting out another timeout) and raises GroupError naming the rank, backend
and timeout. ``TPGroup`` (``group.py``) builds the typed collectives on it: what each
sends, and how a failure travels through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tpcache.group.join import first_line
from tpcache.group.spec import I64_MAX, I64_MIN, GroupError, GroupInputError

_T = TypeVar("_T")


class Wire:
    """A process group (``pg``: a ``dist.ProcessGroup`` or a backend such as
    ``ProcessGroupGloo``; its own methods are called, so it need not be registered with
    ``torch.distributed``) whose int64 and byte tensors live on ``device``."""

    def __init__(
        self, pg: Any, *, backend: str, device: torch.device, timeout_s: float, where: str
    ) -> None:
        self.pg = pg  # None once closed
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.where = where  # names the rank and its address in every message
        # Owned here; set once, by the first failure or by close().
        self.broken: str | None = None
        self.collectives = 0  # owned here: collectives entered so far

    def close(self) -> None:
        """Drop the group (its owner's life goes on); later collectives raise."""
        if self.broken is None:
            self.broken = "destroyed"
        self.pg = None

    def run(self, op: str, fn: Callable[[], _T]) -> _T:
        """Enter one collective, ``fn``; GroupError (the group broken) if it fails."""
        self.check_open(op)
        self.collectives += 1
        try:
            return fn()
        except Exception as exc:
            raise self.fail(op, first_line(exc)) from exc

    def all_reduce(self, op: str, t: torch.Tensor, reduce_op: dist.ReduceOp) -> None:
        """Reduce ``t`` over the ranks in place (``run``)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = reduce_op
        self.run(op, lambda: self.pg.allreduce([t], opts).wait())

    def broadcast(self, op: str, t: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``t`` into every rank's ``t`` (``run``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.run(op, lambda: self.pg.broadcast([t], opts).wait())

    def ints(self, op: str, values: Sequence[int]) -> list[int]:
        """``values`` as int64s, checked before any collective: GroupInputError for a
        non-int, one out of int64 range, or an empty list; GroupError if broken."""
        self.check_open(op)
        xs: list[int] = []
        for v in values:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise GroupInputError(f"{op}: {v!r} is not an int ({self.where})")
            x = v.__index__()
            if not I64_MIN <= x <= I64_MAX:
                raise GroupInputError(
                    f"{op}: {x} does not fit in int64; carry u64 with u64_to_i64 ({self.where})"
                )
            xs.append(x)
        if not xs:
            raise GroupInputError(f"{op}: empty list ({self.where})")
        return xs

    def tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=self.device)

    def unpack(self, op: str, t: torch.Tensor) -> list[int]:
        """Check the [n, ~n] header of a MIN-reduced tensor; return the body."""
        vals = t.tolist()
        lo, hi = vals[0], ~vals[1]
        if lo != hi:
            raise self.fail(op, f"ranks passed lists of different lengths ({lo} to {hi})")
        return vals[2:]

    def check_open(self, op: str) -> None:
        if self.broken is not None:
            raise GroupError(f"{op}: group is unusable ({self.broken}) for {self.where}")

    def fail(self, op: str, why: str, *, broken: bool = True) -> GroupError:
        """The GroupError of ``op``; marks the group broken unless ``broken`` is False
        (a failure that travelled through a collective that itself went well)."""
        if broken:
            self.broken = f"{op} failed: {why}"
        return GroupError(
            f"{op} failed for {self.where} ({self.backend}, timeout {self.timeout_s:g}s): {why}"
        )
