"""The errors of the lockstep protocol, apart from it: a client that only re-raises them
(``tpcache.client``) imports neither torch nor the process group."""

from __future__ import annotations

from typing import ClassVar

from tpcache.errors import TpcacheError


class WhereError(TpcacheError, RuntimeError):
    """An error that happened at one place of the group (a step, a rank): its message is
    ``"{where}: {detail}"``. It pickles (through Ray, or a process pool) as its
    constructor's arguments, read back from the attributes ``_fields`` names in order,
    so a subclass's own fields travel with it and its message is not built twice."""

    _fields: ClassVar[tuple[str, ...]]  # each concrete subclass's constructor arguments

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.detail = detail

    def __reduce__(self):
        return (type(self), tuple(getattr(self, name) for name in self._fields))


class LockstepError(WhereError):
    """The group can no longer go on in lockstep; the coordinator must recover.

    Retryable for a frontend: the requests it held are lost, new ones can be admitted
    once the coordinator has recovered.
    """

    retryable = True
    _fields = ("step", "detail")

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"step {step}", message)
        self.step = step


class DivergenceError(LockstepError):
    """Ranks hold different cache states after ``step``.

    ``odd_ranks`` is filled in by whoever gathered every rank's digest (the coordinator).
    """

    _fields = ("step", "detail", "odd_ranks")

    def __init__(self, step: int, message: str, odd_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(step, message)
        self.odd_ranks = odd_ranks


class RankFailure(LockstepError):
    """An op failed on at least one rank during ``step``. ``local``: raised by the rank
    where it failed (the others only heard of it through an agreement), so whoever
    gathers the ranks' errors can name that rank."""

    _fields = ("step", "detail", "local")

    def __init__(self, step: int, message: str, local: bool = False) -> None:
        super().__init__(step, message)
        self.local = local


__all__ = ["DivergenceError", "LockstepError", "RankFailure", "WhereError"]


class UnknownOp(TpcacheError, TypeError):
    """A step or command carries an op this rank does not know (a peer of another
    version, or a bug)."""
