"""Block hashes are computed lazily unless events need them: same digests either way,
and a cache nobody asks for a digest keeps no evicted node alive."""

from __future__ import annotations

import random

import numpy as np

from tpcache.cache.blocks import cached_blocks
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.tree.hashing import PageHasher, fold_fields
from tpcache.cache.tree.node import _BATCH_PAGES


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
        assert lazy.tree.unhashed or lazy.tree.evicted_pages  # lazy really deferred
        assert lazy.digest() == eager.digest()
    assert lazy.tree.evicted_pages > 0
    assert cached_blocks(lazy) == cached_blocks(eager)
    lazy.check_integrity()
    eager.check_integrity()


def test_no_digest_keeps_no_dead_nodes():
    cache = RadixCache(CacheConfig(256, 4))
    drive(cache, random.Random(7), 3000)
    assert cache.tree.evicted_pages > 1000
    assert len(cache.tree.unhashed) <= 2 * len(cache.tree.nodes) + 1025


def test_hybrid_lazy_and_eager_hashing_agree():
    from tpcache.cache.swa.cache import HybridCache
    from tpcache.cache.swa.config import HybridConfig

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


def random_run(rng: np.random.Generator, ps: int, pages: int) -> tuple[np.ndarray, int]:
    """Tokens of ``pages`` whole pages (any id up to the largest) and any u64 parent state."""
    key = rng.integers(0, 2**31, size=pages * ps, dtype=np.int64).astype(np.int32)
    return key, int(rng.integers(0, 2**64, dtype=np.uint64))


def seeded_hashers(seed: int) -> tuple[np.random.Generator, list[PageHasher]]:
    """A seeded generator (the seed printed) and hashers for odd and even page sizes,
    which take different premix paths."""
    print(f"seed={seed}")
    return np.random.default_rng(seed), [PageHasher(ps) for ps in (1, 3, 4, 16)]


def test_chain_runs_equals_each_runs_chain():
    # The batched chain of a step's new nodes must give every node exactly the states
    # its own chain gives.
    rng, hashers = seeded_hashers(90210)
    for hasher in hashers:
        ps = hasher.page_size
        for _ in range(20):
            sizes = rng.integers(1, 40, size=rng.integers(1, 9))
            runs = [random_run(rng, ps, int(m)) for m in sizes]
            parents = np.array([p for _, p in runs], dtype=np.uint64)
            starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
            key = np.concatenate([k for k, _ in runs])
            got = hasher.chain_runs(key, starts, sizes.astype(np.int64), parents)
            want = np.concatenate([hasher.chain(k, p) for k, p in runs])
            assert np.array_equal(got, want), (ps, sizes)


def test_chain_pages_equals_chain_runs_of_one_page_runs():
    rng, hashers = seeded_hashers(4711)
    for hasher in hashers:
        ps = hasher.page_size
        for count in (2, 3, 8, 33):
            runs = [random_run(rng, ps, 1) for _ in range(count)]
            parents = np.array([p for _, p in runs], dtype=np.uint64)
            key = np.concatenate([k for k, _ in runs])
            ones = np.ones(count, dtype=np.int64)
            want = hasher.chain_runs(key, np.arange(count, dtype=np.int64), ones, parents)
            assert np.array_equal(hasher.chain_pages(key, parents), want), (ps, count)


def test_batches_larger_than_the_cap_and_deep_pending_chains():
    # Pending nodes over several batches (more than _BATCH_PAGES pages), one node longer
    # than a batch, and chains of pending parents (a conversation growing turn by turn
    # with no digest in between): the digest and blocks equal eager hashing's.
    lazy = RadixCache(CacheConfig(40_000, 1))
    eager = RadixCache(CacheConfig(40_000, 1, record_events=True))
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 9999) for _ in range(_BATCH_PAGES + 7)]]
    for turn in range(12):  # each turn extends the last: a pending chain 12 deep
        prompts.append(prompts[-1] + [rng.randrange(1, 9999) for _ in range(300 + turn)])
    prompts += [[rng.randrange(1, 9999) for _ in range(700)] for _ in range(8)]
    for i, prompt in enumerate(prompts):
        for cache in (lazy, eager):
            cache.admit(i, prompt)
            cache.finish(i)
    assert len(lazy.tree.unhashed) > 20
    assert lazy.digest() == eager.digest()
    assert cached_blocks(lazy) == cached_blocks(eager)
    lazy.check_integrity()


def test_a_node_pending_twice_is_hashed_once():
    # Batches hash a level's nodes together: a node listed twice must not count twice.
    once = RadixCache(CacheConfig(512, 4))
    twice = RadixCache(CacheConfig(512, 4))
    for cache in (once, twice):
        drive(cache, random.Random(5), 20)
    twice.tree.unhashed = twice.tree.unhashed + twice.tree.unhashed[-3:]
    assert once.digest() == twice.digest()
    twice.check_integrity()


def test_chain_few_equals_chain():
    # A node of a few pages is hashed in Python ints: the same states as numpy's chain,
    # for odd and even page sizes, tokens up to the largest id, any parent state.
    rng, hashers = seeded_hashers(31337)
    for hasher in hashers:
        ps = hasher.page_size
        for pages in (1, 2, 3, 4, 6):
            for _ in range(10):
                key, parent = random_run(rng, ps, pages)
                want = hasher.chain(key, parent).tolist()
                assert hasher.chain_few(key.tobytes(), parent) == want, (ps, pages)


def test_a_pending_node_whose_parent_is_not_listed_is_still_hashed():
    # hash_pending hashes level by level; a node whose unhashed parent is missing from
    # the list (no path does that today) goes through hash_node's walk up the chain
    # instead of stalling the loop.
    lazy = RadixCache(CacheConfig(4096, 4))
    eager = RadixCache(CacheConfig(4096, 4, record_events=True))
    stem = list(range(1, 41))
    for cache in (lazy, eager):
        for turn in range(4):  # each turn extends the last: pending parents and children
            cache.admit(turn, stem + list(range(100, 100 + 8 * (turn + 1))))
            cache.finish(turn)
    pending = lazy.tree.unhashed
    leaves = [n for n in pending if not n.children]
    assert any(n.parent.states is None for n in leaves)  # a parent still waits too
    lazy.tree.unhashed = leaves
    assert lazy.digest() == eager.digest()
    assert cached_blocks(lazy) == cached_blocks(eager)
    lazy.check_integrity()


def test_fold_fields_changes_with_any_one_field():
    # The digest's fields are folded by a polynomial with an odd multiplier: a change of
    # any single field, by any nonzero amount (negative values too), must change it.
    seed = 4242
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(300):
        fields = tuple(rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(1, 12)))
        seed_value = rng.getrandbits(64)
        base = fold_fields(seed_value, fields)
        assert 0 <= base < 2**64
        assert fold_fields(seed_value ^ 1, fields) != base
        for i in range(len(fields)):
            delta = rng.choice((1, -1, 2**32, rng.randrange(1, 2**40)))
            moved = (*fields[:i], fields[i] + delta, *fields[i + 1 :])
            assert fold_fields(seed_value, moved) != base, (fields, i, delta)
        if len(fields) > 1:  # order matters: swapping two different fields changes it
            a, b = fields[0], fields[1]
            if a != b:
                assert fold_fields(seed_value, (b, a, *fields[2:])) != base
