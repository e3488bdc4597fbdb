"""The host tier's KV events as a router's index reads them (``BlockIndex``): a host
copy's parent is often still on the GPU (the tiers are exclusive under write-back, and a
prefix leaves the device leaf first), so a parent counts if any medium stores it; the
index then holds exactly what each tier holds, and its snapshot rebuilds it."""

from __future__ import annotations

import random

import pytest

from tpcache.cache.errors import HostTierError
from tpcache.cache.events import BlockRemoved, BlockStored
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.events.block_index import BlockIndex, ProblemKind


def stored(hashes, parent=None, medium="GPU", size=2):
    return BlockStored(hashes, parent, [h % 100 for h in hashes for _ in range(size)], size,
                       medium=medium)  # fmt: skip


def test_a_parent_on_another_medium_is_a_known_parent() -> None:
    idx = BlockIndex()
    assert idx.apply(stored([1, 2])) == []
    assert idx.apply(stored([3], parent=2, medium="CPU")) == []
    # The same hash on two media: removing one copy leaves the other as a parent.
    assert idx.apply(stored([2], parent=1, medium="CPU")) == []
    assert idx.apply(BlockRemoved([2], medium="GPU")) == []
    assert idx.apply(stored([4], parent=2, medium="CPU")) == []
    assert idx.apply(BlockRemoved([2], medium="CPU")) == []
    problems = idx.apply(stored([5], parent=2, medium="CPU"))  # stored nowhere now
    assert [(p.kind, p.block_hash) for p in problems] == [(ProblemKind.UNKNOWN_PARENT, 2)]


def test_a_snapshot_puts_a_parent_on_another_medium_first_and_keeps_runs_on_one() -> None:
    idx = BlockIndex()
    idx.apply_all([stored([3], parent=2, medium="CPU"), stored([1, 2]),
                   stored([4], parent=3, medium="CPU")])  # fmt: skip
    events = idx.to_events()
    assert [(e.medium, e.block_hashes) for e in events] == [("GPU", [1, 2]), ("CPU", [3, 4])]
    rebuilt = BlockIndex()
    assert rebuilt.apply_all(events) == []
    assert rebuilt.keys() == idx.keys()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_host_tiers_events_fold_into_what_each_tier_holds(policy, page_size) -> None:
    """Random admits, finishes, evictions and resets over a small device pool: the index
    the events build reports no problem and holds, per medium, one block per page each
    tier holds (the device's cached pages, the host's pages). Seeded."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cfg = HostConfig(16 * page_size, page_size, "lru", host_capacity_tokens=48 * page_size,
                     write_policy=policy, write_through_hits=1, record_events=True)  # fmt: skip
    cache = HostCache(cfg)
    idx = BlockIndex()
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 6) * page_size)]
                for _ in range(6)]  # fmt: skip
    for i in range(300):
        roll = rng.random()
        if roll < 0.02:
            cache.reset()
        elif roll < 0.1:
            cache.evict(rng.randrange(1, 8) * page_size)
        else:
            prompt = rng.choice(prefixes) + [
                rng.randrange(1, 50) for _ in range(rng.randrange(0, 3 * page_size))
            ]
            cache.admit(i, prompt, reserve=page_size)
            cache.finish(i, [rng.randrange(1, 50) for _ in range(page_size)])
        assert idx.apply_all(cache.take_events()) == [], f"call {i}"
        cache.check_integrity()
        tree = cache.tree
        keys = idx.keys()
        media = [m for m, _ in keys]
        assert media.count("GPU") == tree.cached_pages, f"call {i}"
        assert media.count("CPU") == tree.host_pages, f"call {i}"


def test_the_host_tiers_own_medium_is_refused_for_the_device() -> None:
    with pytest.raises(HostTierError, match="host tier's own"):
        HostConfig(64, 1, "lru", host_capacity_tokens=8, medium="CPU")
