"""Block hashes are computed lazily unless events need them: same digests either way,
and a cache nobody asks for a digest keeps no evicted node alive."""

from __future__ import annotations

import random

from tpcache.cache.blocks import cached_blocks
from tpcache.cache.radix import CacheConfig, RadixCache


def drive(cache: RadixCache, rng: random.Random, n: int) -> None:
    stems = [[rng.randrange(1, 400) for _ in range(rng.randrange(4, 80))] for _ in range(6)]
    for i in range(n):
        prompt = rng.choice(stems) + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 40))]
        cache.admit(i, prompt)
        cache.extend(i, 3)
        cache.finish(i, [rng.randrange(1, 400) for _ in range(3)])


def test_lazy_and_eager_hashing_give_the_same_digest_and_blocks():
    seed = 4242
    print(f"seed={seed}")
    lazy = RadixCache(CacheConfig(512, 4))
    eager = RadixCache(CacheConfig(512, 4, record_events=True))
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    for _ in range(6):
        drive(lazy, rng_a, 25)
        drive(eager, rng_b, 25)
        assert lazy.tree._unhashed or lazy.tree.evicted_pages  # lazy really deferred
        assert lazy.digest() == eager.digest()
    assert lazy.tree.evicted_pages > 0
    assert cached_blocks(lazy) == cached_blocks(eager)
    lazy.check_integrity()
    eager.check_integrity()


def test_no_digest_keeps_no_dead_nodes():
    cache = RadixCache(CacheConfig(256, 4))
    drive(cache, random.Random(7), 3000)
    assert cache.tree.evicted_pages > 1000
    assert len(cache.tree._unhashed) <= 2 * len(cache.tree.nodes) + 1025


def test_hybrid_lazy_and_eager_hashing_agree():
    from tpcache.cache.swa_cache import HybridCache
    from tpcache.cache.swa_config import HybridConfig

    seed = 99
    print(f"seed={seed}")
    lazy = HybridCache(HybridConfig(512, 256, 16, 4))
    eager = HybridCache(HybridConfig(512, 256, 16, 4, record_events=True))
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    for _ in range(4):
        drive(lazy, rng_a, 20)
        drive(eager, rng_b, 20)
        assert lazy.digest() == eager.digest()
    assert cached_blocks(lazy) == cached_blocks(eager)
    lazy.check_integrity()
