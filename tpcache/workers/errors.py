"""The errors of the lockstep protocol, apart from it: a client that only re-raises them
(``tpcache.client``) imports neither torch nor the process group."""

from __future__ import annotations

from tpcache.errors import TpcacheError


class LockstepError(TpcacheError, RuntimeError):
    """The group can no longer go on in lockstep; the coordinator must recover.

    Retryable for a frontend: the requests it held are lost, new ones can be admitted
    once the coordinator has recovered.
    """

    retryable = True

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"step {step}: {message}")
        self.step = step
        self.detail = message

    def __reduce__(self):
        return (type(self), (self.step, self.detail))


class DivergenceError(LockstepError):
    """Ranks hold different cache states after ``step``.

    ``odd_ranks`` is filled in by whoever gathered every rank's digest (the coordinator).
    """

    def __init__(self, step: int, message: str, odd_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(step, message)
        self.odd_ranks = odd_ranks

    def __reduce__(self):
        return (type(self), (self.step, self.detail, self.odd_ranks))


class RankFailure(LockstepError):
    """An op failed on at least one rank during ``step``. ``local``: raised by the rank
    where it failed (the others only heard of it through an agreement), so whoever
    gathers the ranks' errors can name that rank."""

    def __init__(self, step: int, message: str, local: bool = False) -> None:
        super().__init__(step, message)
        self.local = local

    def __reduce__(self):
        return (type(self), (self.step, self.detail, self.local))


__all__ = ["DivergenceError", "LockstepError", "RankFailure"]
