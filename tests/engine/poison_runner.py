"""A reference runner that refuses every batch holding token id ``POISON`` (as a runner
refuses ids outside its vocabulary): every rank refuses, the group stays up."""

from __future__ import annotations

from tpcache.model.reference import ReferenceRunner
from tpcache.model.runner import RunnerInputError

POISON = 63


class PoisonRunner(ReferenceRunner):
    def check_batch(self, batch) -> None:
        super().check_batch(batch)
        if bool((batch.tokens == POISON).any()):
            raise RunnerInputError(f"token {POISON} is refused by this runner")
