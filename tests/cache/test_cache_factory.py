"""The one cache factory (``cache/factory.py``): every kind from one spec, the same cache
for a rank, the mirror and a replay, and the one combination it refuses."""

from __future__ import annotations

import pytest

from tpcache.cache.errors import HostTierError, SwaHostTierError
from tpcache.cache.factory import CacheSpec, build
from tpcache.cache.host.cache import HostCache
from tpcache.cache.radix import RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import InvalidConfig
from tpcache.replay import ReplayOptions, make_cache
from tpcache.workers.spec import CacheSpec as WorkerCacheSpec


def test_the_workers_spec_is_the_factorys() -> None:
    assert WorkerCacheSpec is CacheSpec


@pytest.mark.parametrize(
    "kw, kind",
    [
        ({}, RadixCache),
        ({"sliding_window": 64, "swa_capacity_tokens": 512}, HybridCache),
        ({"host_capacity_tokens": 2048}, HostCache),
    ],
)
def test_each_spec_builds_its_kind(kw: dict, kind: type) -> None:
    cache = build(CacheSpec(**kw), 1024)
    assert type(cache) is kind
    assert cache.config.capacity_tokens == 1024


def test_a_replay_and_a_lockstep_build_the_same_cache() -> None:
    opts = ReplayOptions(1024, 16, swa_window=64, swa_capacity=512)
    spec = CacheSpec(page_size=16, sliding_window=64, swa_capacity_tokens=512)
    caches = [make_cache(opts, 1024)[0], spec.build(1024), build(spec, 1024)]
    for cache in caches:
        cache.admit("r", list(range(100)), reserve=20)
        cache.finish("r", list(range(100, 120)))
    assert len({c.digest() for c in caches}) == 1
    assert caches[0].digest() != build(spec, 1024).digest()  # the ops changed it


def test_a_window_and_a_host_tier_are_refused_naming_both() -> None:
    with pytest.raises(SwaHostTierError, match=r"sliding_window .* host_capacity_tokens"):
        CacheSpec(sliding_window=64, host_capacity_tokens=4096)
    with pytest.raises(HostTierError):  # still a HostTierError for callers that catch that
        make_cache(ReplayOptions(1024, 16, swa_window=64, host_capacity=4096), 1024)


def test_a_replays_swa_pool_larger_than_the_full_one_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="may not be larger"):
        make_cache(ReplayOptions(1024, 16, swa_window=64, swa_capacity=2048), 1024)
    # A lockstep's SWA pool is cut to the capacity the ranks agree on instead.
    cache = CacheSpec(sliding_window=64, swa_capacity_tokens=2048).build(1024)
    assert cache.pool_sizes()[1].capacity == 1024
