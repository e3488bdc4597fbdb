"""Admit with ``reserve`` (output slots allocated with the prompt) and prompts given in
immutable buffers (kept without a copy), on the base and the hybrid cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import snapshot, tree_nodes

from tpcache.cache.errors import CacheError, InvalidTokens, OutOfCapacity
from tpcache.cache.keys import as_tokens, frozen_tokens, is_frozen
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

KINDS = ("base", "hybrid")


def _make(kind: str, capacity: int, page_size: int, limit: int | None = None):
    if kind == "base":
        return RadixCache(CacheConfig(capacity, page_size, max_request_tokens=limit))
    assert limit is None
    return HybridCache(HybridConfig(capacity, capacity, 3 * page_size, page_size, "lru"))


def _requests(seed: int, n: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt, output, reserve) with shared prefixes; reserves below, at and above the
    output's length."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 900) for _ in range(rng.randrange(1, 50))] for _ in range(4)]
    out = []
    for _ in range(n):
        prompt = rng.choice(stems) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(1, 900) for _ in range(rng.randrange(0, 20))]
        reserve = rng.choice([0, len(output), len(output) + 3, max(0, len(output) - 5)])
        out.append((prompt, output, reserve))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_admit_with_reserve_is_admit_then_extend(kind: str, page_size: int) -> None:
    # Where nothing is evicted, one allocation of prompt + reserve must hand out exactly
    # the pages (in the same order) that admit and then extend(reserve) hand out.
    seed = 4100 + page_size
    print(f"seed={seed}")
    one, two = _make(kind, 8192, page_size), _make(kind, 8192, page_size)
    for i, (prompt, output, reserve) in enumerate(_requests(seed, 80)):
        a = one.admit(i, prompt, reserve=reserve)
        b = two.admit(i, prompt)
        more = two.extend(i, reserve)
        assert (a.prefix_len, a.num_tokens) == (b.prefix_len, len(prompt) + reserve)
        assert a.slots.tolist() == b.slots.tolist() + more.tolist()
        if kind == "hybrid":
            assert a.swa_slots.tolist() == b.swa_slots.tolist() + two.swa.slots(more).tolist()
        extra = len(output) - reserve
        if extra > 0:  # decode past the reserve, as an engine would
            assert one.extend(i, extra).tolist() == two.extend(i, extra).tolist()
        assert one.finish(i, output) == two.finish(i, output)
        assert one.digest() == two.digest(), f"request {i}"
    assert one.tree.evicted_pages == 0
    one.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_reserve_under_eviction_keeps_every_count(kind: str) -> None:
    seed = 4200
    print(f"seed={seed}")
    c = _make(kind, 256, 4)
    hits = 0
    for i, (prompt, output, reserve) in enumerate(_requests(seed, 200)):
        got = c.admit(i, prompt, reserve=reserve)
        hits += got.prefix_len
        assert got.num_tokens == len(prompt) + reserve
        assert len(set(got.slots.tolist())) == got.num_tokens
        c.finish(i, output)
        c.check_integrity()
    assert c.tree.evicted_pages > 0 and hits > 0
    assert c.sizes().held == 0


def test_reserve_past_the_output_is_freed_and_output_past_it_is_not_cached() -> None:
    c = RadixCache(CacheConfig(64, 4))
    prompt = list(range(1, 6))  # 5 tokens: 2 pages
    got = c.admit("a", prompt, reserve=8)  # 13 tokens: 4 pages
    assert got.pages.tolist() == [0, 1, 2, 3] and got.num_tokens == 13
    assert c.sizes().held == 16
    # 5 + 2 = 7 tokens have KV: one whole page is cached, the other three go back
    assert c.finish("a", [90, 91]) == 4
    assert tree_nodes(c) == [([1, 2, 3, 4], [0], 0)]
    assert (c.sizes().free, c.sizes().held) == (60, 0)
    # an output longer than the reserve: only the tokens with slots are cached
    c.admit("b", [7, 8, 9], reserve=2)  # 5 slots: pages 4, 5 (from the FIFO's head)
    assert c.finish("b", [10, 11, 12, 13, 14]) == 4
    assert tree_nodes(c)[-1] == ([7, 8, 9, 10], [4], 0)
    c.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_reserve_raises_and_changes_nothing(kind: str) -> None:
    c = _make(kind, 64, 4)
    c.admit("run", list(range(1, 30)))
    c.finish("run")
    c.admit("held", list(range(1, 21)), reserve=3)  # locks a prefix
    before = (snapshot(c), tree_nodes(c))
    for bad in (-1, True, 2.5, "3", None, np.int64(2)):
        with pytest.raises(CacheError, match="reserve"):
            c.admit("x", list(range(1, 12)), reserve=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokens, match="reserved exceeds the limit"):
        c.admit("x", list(range(1, 12)), reserve=64)
    # fits the limit but not the pool: the match is not left locked
    with pytest.raises(OutOfCapacity):
        c.admit("x", list(range(1, 12)), reserve=50)
    assert (snapshot(c), tree_nodes(c)) == before
    with pytest.raises(CacheError):
        c.finish("x")  # never admitted
    c.finish("held")
    c.check_integrity()


def test_the_request_limit_counts_the_reserve() -> None:
    c = RadixCache(CacheConfig(64, 4, max_request_tokens=10))
    with pytest.raises(InvalidTokens, match="prompt of 6 tokens \\+ 5 reserved"):
        c.admit("a", list(range(1, 7)), reserve=5)
    assert c.admit("a", list(range(1, 7)), reserve=4).num_tokens == 10
    with pytest.raises(InvalidTokens, match="limit 10"):
        c.extend("a", 1)


def test_frozen_tokens_refuses_what_as_tokens_refuses() -> None:
    # Regression: it cast to int32 unchecked, so 2**40 became 0 and -3 stayed -3.
    for bad in ([2**40], [1, -3], [1.5], [[1, 2]]):
        with pytest.raises(InvalidTokens):
            frozen_tokens(bad)
    assert frozen_tokens([5, 6]).tolist() == [5, 6] and frozen_tokens([]).size == 0


def test_a_frozen_prompt_is_kept_without_a_copy_and_a_mutable_one_is_copied() -> None:
    src = np.arange(1, 41, dtype=np.int32)
    frozen = frozen_tokens(src)
    assert is_frozen(frozen) and is_frozen(frozen[4:9])
    with pytest.raises(ValueError):
        frozen.flags.writeable = True  # the premise: nobody can write into it
    assert np.shares_memory(as_tokens(frozen, copy=True), frozen)
    readonly_view = src.view()
    readonly_view.flags.writeable = False
    mutable_cases = (src, readonly_view, np.frombuffer(bytearray(src.tobytes()), np.int32))
    for arr in mutable_cases:
        assert not is_frozen(arr)
        assert not np.shares_memory(as_tokens(arr, copy=True), arr)
    # A frozen prompt gives the cache the same state as a mutable one, and the row is it.
    a, b = RadixCache(CacheConfig(128, 4)), RadixCache(CacheConfig(128, 4))
    a.admit("r", frozen, reserve=3)
    b.admit("r", src.copy(), reserve=3)
    assert np.shares_memory(a.reqs.get("r").tokens, frozen)
    a.finish("r", [5, 6, 7])
    b.finish("r", [5, 6, 7])
    assert a.digest() == b.digest() and tree_nodes(a) == tree_nodes(b)
