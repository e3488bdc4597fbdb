"""The coordinator's check of what its ranks answered: every rank's result for every
step (its digest, what each op returned, the copy count it agreed) must equal what the
mirror expects; a rank whose result differs is odd (``steps.StepPipeline`` stops the
group at that step and names it).
"""

from __future__ import annotations

from tpcache.coordinator.copy_agree import CopyCompletion
from tpcache.coordinator.step_types import Closed, RankCallError, RankTransport
from tpcache.lockstep.ops import decode_result


def odd_ranks(step: Closed, outs: list[bytes], copies: CopyCompletion) -> tuple[list[int], float]:
    """The ranks whose encoded result in ``outs`` (one per rank) differs from what the
    mirror expects for ``step``, and the slowest rank's time on the step's ops (seconds).
    ``copies`` notes the copy count the ranks agreed (where they agree on it)."""
    odd: list[int] = []
    ops_us = 0.0
    got_all = [decode_result(out) for out in outs]
    for got in got_all:
        ops_us = max(ops_us, got.ops_us)
        if got.digest != step.digest or got.results != step.expected:
            odd.append(got.rank)
    if not odd and (bad := copies.note(got_all)) is not None:
        odd.append(bad)
    return odd, ops_us * 1e-6


def odd_by_digest(ranks: RankTransport, mirror_digest: int) -> tuple[int, ...]:
    """Gather every rank's digest; the ranks whose digest differs from the mirror's
    (none when a rank cannot be asked). After a divergence the ranks raised together, so
    only their digests can name the odd one."""
    try:
        digests = ranks.call("digest")
    except RankCallError:
        return ()
    return tuple(r for r, d in enumerate(digests) if d != mirror_digest)
