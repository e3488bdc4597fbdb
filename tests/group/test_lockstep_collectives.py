"""Every rank enters the same collectives in the same order: one MIN agreement per op
whose eviction the log asks for, plus, on the Ray actor path, one per step for the status
and digest (the step channel leaves that check to the coordinator: ``Step.peer_check``)
(real Ray ranks, real gloo), and the result equals one in-process cache's."""

from __future__ import annotations

import random

import numpy as np
import pytest
from group_helpers import PAGE, group_config

from tpcache.frontend.service import start_group
from tpcache.workers.rank import CacheSpec

SPEC = CacheSpec(page_size=PAGE, policy="lru", max_request_tokens=64)


def requests(seed: int, n: int) -> list[list[int]]:
    """Prompts of 9-24 tokens, half of them on one of three shared prefixes."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 500) for _ in range(8)] for _ in range(3)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 17))]
        out.append((rng.choice(heads) if rng.random() < 0.5 else []) + tail)
    return out


@pytest.mark.parametrize(("tp", "transport"), [(2, "channel"), (4, "channel"), (2, "ray")])
def test_collectives_per_step_are_the_evicting_ops_and_the_check(
    ray_cluster, tp: int, transport: str
) -> None:
    seed = 70 + tp
    print(f"seed={seed}")
    coord = start_group(
        group_config(
            tp,
            capacity_tokens=24 * PAGE,
            cache=SPEC,
            num_layers=1,
            cpu_budget_bytes=1 << 22,
            transport=transport,
        )
    )
    checks = 1 if transport == "ray" else 0  # the ranks' own digest check, per step
    ref = SPEC.build(24 * PAGE)
    try:
        before = [info["collectives"] for info in coord.ranks.call("info")]
        steps = evicting = most = 0
        reqs = requests(seed, 48)
        for s, batch in enumerate(reqs[i : i + 6] for i in range(0, len(reqs), 6)):
            in_step = 0
            with coord.batch():
                for j, prompt in enumerate(batch):
                    rid = f"r{s}.{j}"
                    gone = ref.tree.evicted_pages
                    want = ref.admit(rid, prompt)
                    in_step += ref.tree.evicted_pages > gone
                    got = coord.admit(rid, prompt)
                    assert got.prefix_len == want.prefix_len
                    assert np.array_equal(got.slots, want.slots)  # the same slot ids
                    ref.finish(rid, [7])
                    coord.finish(rid, [7])
            coord.sync()
            steps += 1
            evicting += in_step
            most = max(most, in_step)
        assert most >= 3, "the workload must put several evictions in one step"
        after = [info["collectives"] for info in coord.ranks.call("info")]
        assert after == [b + checks * steps + evicting for b in before]  # on every rank
        # each collected step reports the slowest rank's time on its ops (before the
        # collective), and some of it was spent
        ops_s = list(coord.counters.rank_ops_s)[-steps:]
        assert len(ops_s) == steps and min(ops_s) > 0
        assert coord.ranks.call("digest") == [ref.digest()] * tp
        assert coord.mirror.digest() == ref.digest()
        coord.ranks.call("check_integrity")
    finally:
        coord.close()
