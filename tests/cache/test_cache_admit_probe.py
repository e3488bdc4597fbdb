"""``admit_prefix_len``: what an admit would match, asked without changing anything (the
generate loop's scheduler asks it before it decides whom to admit)."""

from __future__ import annotations

import numpy as np
import pytest
from swa_helpers import hybrid

from tpcache.cache.errors import InvalidTokens
from tpcache.cache.radix import CacheConfig, RadixCache

SEED = 2117


def _base() -> RadixCache:
    return RadixCache(CacheConfig(4096, 4, policy="lru"))


@pytest.mark.parametrize("make", [_base, lambda: hybrid(4096, 4096, 8, 4)], ids=["base", "hybrid"])
def test_probe_equals_the_admit_after_it_and_changes_nothing(make) -> None:
    print(f"seed {SEED}")
    rng = np.random.default_rng(SEED)
    cache = make()
    stems = [rng.integers(1, 50, size=int(rng.integers(1, 40))) for _ in range(6)]
    hits = 0
    for rid in range(120):
        stem = stems[int(rng.integers(0, len(stems)))]
        tail = rng.integers(1, 50, size=int(rng.integers(0, 12)))
        prompt = np.concatenate((stem[: int(rng.integers(1, stem.size + 1))], tail))
        before = cache.digest()
        probed = cache.admit_prefix_len(prompt)
        assert cache.digest() == before  # pure: no split, no access tick
        got = cache.admit(rid, prompt)
        assert got.prefix_len == probed, (rid, prompt.tolist())
        hits += probed
        if rid % 3:
            cache.finish(rid, rng.integers(1, 50, size=2))
        elif rid % 2:
            cache.cache_unfinished(rid, prompt)  # still running, its prompt cached
        else:
            cache.abort(rid)
        if rid % 17 == 16:
            cache.evict(64)
    cache.check_integrity()
    assert hits > 0  # the workload did reuse prefixes


def test_probe_bounds_and_bad_tokens() -> None:
    cache = _base()
    cache.admit("a", list(range(1, 10)))
    cache.finish("a")
    assert cache.admit_prefix_len(list(range(1, 10))) == 8  # at most len - 1, whole pages
    assert cache.admit_prefix_len(list(range(1, 9))) == 4
    assert cache.admit_prefix_len([1, 2, 3, 4, 5, 6, 99]) == 4
    assert cache.admit_prefix_len([7]) == 0
    with pytest.raises(InvalidTokens):
        cache.admit_prefix_len([1, -2, 3])
