"""Bad input gets a typed error and leaves the cache as it was; every key type agrees."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from cache_helpers import snapshot, tree_nodes

from tpcache.cache.errors import (
    AllocatorError,
    CacheError,
    DuplicateRequest,
    InvalidSlots,
    InvalidTokens,
    LockError,
    OutOfCapacity,
    UnknownHandle,
    UnknownRequest,
)
from tpcache.cache.keys import int_sum, join_pages, joined_key, key_bytes, min_value
from tpcache.cache.radix import CacheConfig, Handle, RadixCache

P = list(range(100, 110))  # 10 tokens: 2 whole pages of 4 and a partial one


def _busy_cache() -> tuple[RadixCache, np.ndarray]:
    """Page size 4, 64 slots: a cached prompt, a running request, 8 loose caller slots."""
    c = RadixCache(CacheConfig(64, 4, record_events=True))
    c.admit("done", P)
    c.finish("done")
    c.admit("run", [*P[:8], 1, 2])
    loose = c.alloc_slots(8)
    c.take_events()
    c.check_integrity()
    return c, loose


BAD_TOKENS: list[tuple[str, object]] = [
    ("empty list", []),
    ("empty array", np.zeros(0, np.int32)),
    ("negative", [1, -2, 3]),
    ("negative int32", np.array([1, -2], np.int32)),
    # Short arrays are scanned in Python, long ones by numpy (keys.min_value): both ways.
    ("negative last of 32 int32", np.r_[np.arange(1, 32), -1].astype(np.int32)),
    ("negative last of 33 int32", np.r_[np.arange(1, 33), -1].astype(np.int32)),
    ("negative last of 500 int32", np.r_[np.arange(1, 500), -7].astype(np.int32)),
    ("too large", [2**31]),
    ("huge python int", [2**70]),
    ("float list", [1.0, 2.0]),
    ("mixed list", [1, 2.5]),
    ("float array", np.array([1.0, 2.0])),
    ("2-D array", np.array([[1, 2], [3, 4]])),
    ("bool list", [True, False]),
    ("strings", ["1", "2"]),
    ("scalar", 5),
    ("None", None),
    ("float tensor", torch.tensor([1.0, 2.0])),
    ("bool tensor", torch.tensor([True])),
    ("2-D tensor", torch.tensor([[1, 2]])),
]


@pytest.mark.parametrize("bad", [b for _, b in BAD_TOKENS], ids=[n for n, _ in BAD_TOKENS])
def test_bad_tokens_raise_invalid_tokens_and_change_nothing(bad: object) -> None:
    c, loose = _busy_cache()
    before = (snapshot(c), tree_nodes(c))
    calls: list[Callable[[], object]] = [
        lambda: c.match_prefix(bad),
        lambda: c.insert(bad, loose[:2]),
        lambda: c.admit("new", bad),
        lambda: c.cache_unfinished("run", bad),
    ]
    for call in calls:
        with pytest.raises(InvalidTokens):
            call()
    if not (isinstance(bad, list) and not bad) and not (
        isinstance(bad, np.ndarray) and bad.size == 0
    ):
        with pytest.raises(InvalidTokens):
            c.finish("run", bad)  # empty output is fine: nothing was generated
    assert (snapshot(c), tree_nodes(c)) == before
    assert c.take_events() == []
    c.check_integrity()


def test_bad_slots_raise_and_change_nothing() -> None:
    c, loose = _busy_cache()
    run_pages = c.reqs.get("run").pages
    run_slots = (run_pages[:, None] * 4 + np.arange(4)).ravel()
    before = (snapshot(c), tree_nodes(c))
    toks = list(range(500, 508))
    cases: list[tuple[type[Exception], str, object]] = [
        (InvalidSlots, "got 7 slot ids for 8 tokens", loose[:7]),
        (InvalidSlots, "not page \\* 4 \\+ offset", np.r_[loose[:3], loose[4], loose[4:8]]),
        (InvalidSlots, "not page \\* 4 \\+ offset", loose[::-1].copy()),
        (InvalidSlots, "must be >= 0", np.r_[loose[:7], -1]),
        (InvalidSlots, "must be integers", loose.astype(np.float64)),
        (InvalidSlots, "1-D", loose.reshape(2, 4)),
        (InvalidSlots, "is free, expected", np.arange(40, 48)),  # never allocated
        (InvalidSlots, "is cached", np.arange(0, 8)),  # the tree's (not a prefix of toks)
        (InvalidSlots, "out of range: must be < 64", np.arange(64, 72)),
        (InvalidSlots, "out of range: must be < 64", np.arange(2**32, 2**32 + 8)),
    ]
    for error, message, slots in cases:
        with pytest.raises(error, match=message):
            c.insert(toks, slots)
        assert (snapshot(c), tree_nodes(c)) == before
    with pytest.raises(InvalidSlots, match="page 3 is held, expected lent"):
        c.insert(toks[:4], run_slots[-4:])  # the running request's own last page
    assert (snapshot(c), tree_nodes(c)) == before
    for slots in ([1, 2, 3], np.arange(40, 44), np.arange(0, 4), run_slots[-4:], 7, "x"):
        with pytest.raises(CacheError):
            c.free_slots(slots)
        assert (snapshot(c), tree_nodes(c)) == before
    c.check_integrity()


def test_slots_of_a_running_request_cannot_be_inserted_or_freed_by_a_caller() -> None:
    # Regression: insert() and free_slots() accepted any HELD page, also one in a running
    # request's row; the tree then owned (or the free list held) a page the row still
    # used, and the request's finish freed it a second time.
    c = RadixCache(CacheConfig(16, 1))
    got = c.admit("r", [1, 2, 3])
    before = snapshot(c)
    with pytest.raises(InvalidSlots):
        c.insert([7, 8, 9], got.slots)
    with pytest.raises(AllocatorError):
        c.free_slots(got.slots)
    assert snapshot(c) == before
    c.finish("r")
    c.check_integrity()


def test_bad_handles_locks_and_requests() -> None:
    c, _ = _busy_cache()
    h = c.match_prefix(P).handle  # ends where "run" holds its lock
    free_h = c.match_prefix([500]).handle  # the root: the empty match
    before = (snapshot(c), tree_nodes(c))
    with pytest.raises(UnknownHandle):
        c.lock(Handle(10_000, h.owner))  # this cache's, naming no node
    with pytest.raises(UnknownHandle):
        c.unlock("h")  # type: ignore[arg-type]
    with pytest.raises(LockError):
        c.unlock(h)  # matched, never locked; the request's lock is not the handle's
    with pytest.raises(LockError):
        c.unlock(free_h)
    c.lock(h)
    c.unlock(h)
    with pytest.raises(LockError):
        c.unlock(h)  # double unlock
    for call in (
        lambda: c.extend("nope", 1),
        lambda: c.finish("nope"),
        lambda: c.abort("nope"),
        lambda: c.cache_unfinished("nope", P),
        lambda: c.extend(7, 1),
    ):
        with pytest.raises(UnknownRequest):
            call()
    with pytest.raises(DuplicateRequest):
        c.admit("run", [1, 2, 3])
    for rid in (None, 1.5, True, b"x", [1], "", "x" * 257, (1,)):
        with pytest.raises(CacheError, match="request id"):
            c.admit(rid, [1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(CacheError, match="request id"):
            c.finish(rid)  # type: ignore[arg-type]
    assert (snapshot(c), tree_nodes(c)) == before
    c.check_integrity()


def test_bad_counts_and_limits() -> None:
    c, loose = _busy_cache()
    before = (snapshot(c), tree_nodes(c))
    run = c.reqs.get("run")
    for n in (-1, 1.5, "2", None, True):
        with pytest.raises(CacheError):
            c.extend("run", n)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokens, match="limit 64"):
        c.extend("run", 64 - run.num_tokens + 1)
    with pytest.raises(InvalidTokens, match="exceeds the limit 64"):
        c.admit("big", list(range(65)))
    with pytest.raises(InvalidTokens, match="do not extend"):
        c.cache_unfinished("run", [*P[:8], 1, 3])
    with pytest.raises(InvalidTokens, match="do not extend"):
        c.cache_unfinished("run", P[:8])  # shorter than what it has
    with pytest.raises(InvalidTokens, match="holds KV for only 10"):
        c.cache_unfinished("run", [*P[:8], 1, 2, 3])
    # True: evict took it as 1 and evicted a page (regression).
    for n in (-1, 2.5, "3", None, True):
        with pytest.raises(CacheError):
            c.evict(n)  # type: ignore[arg-type]
        with pytest.raises(CacheError):
            c.alloc_slots(n)  # type: ignore[arg-type]
    for prio in (1.5, "1", None, True):
        with pytest.raises(CacheError, match="priority"):
            c.admit("p", [1, 2], priority=prio)  # type: ignore[arg-type]
        with pytest.raises(CacheError, match="priority"):
            c.insert(P[:4], loose[:4], priority=prio)  # type: ignore[arg-type]
    assert (snapshot(c), tree_nodes(c)) == before
    c.finish("run")
    with pytest.raises(UnknownRequest):
        c.finish("run")  # finish twice
    with pytest.raises(UnknownRequest):
        c.abort("run")
    c.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_tokens": 0}, "capacity_tokens"),
        ({"capacity_tokens": 3, "page_size": 4}, "capacity_tokens"),
        ({"capacity_tokens": 8, "page_size": 0}, "page_size"),
        ({"capacity_tokens": 8, "page_size": 2.0}, "page_size"),
        ({"capacity_tokens": 8.0}, "capacity_tokens"),
        ({"capacity_tokens": 8, "policy": "random"}, "unknown policy"),
        ({"capacity_tokens": 8, "max_request_tokens": 0}, "max_request_tokens"),
    ],
)
def test_bad_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CacheError, match=message):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_max_request_tokens_limits_prompts_and_extends() -> None:
    c = RadixCache(CacheConfig(64, 4, max_request_tokens=10))
    with pytest.raises(InvalidTokens, match="limit 10"):
        c.admit("a", list(range(11)))
    c.admit("a", list(range(8)))
    with pytest.raises(InvalidTokens, match="limit 10"):
        c.extend("a", 3)
    assert c.extend("a", 2).tolist() == [8, 9]


# ---- key types ----------------------------------------------------------------------------

KEY_TYPES: dict[str, Callable[[list[int]], object]] = {
    "list": lambda t: list(t),
    "tuple": lambda t: tuple(t),
    "int32": lambda t: np.array(t, np.int32),
    "int64": lambda t: np.array(t, np.int64),
    "uint16": lambda t: np.array(t, np.uint16),
    "strided int32": lambda t: np.repeat(np.array(t, np.int32), 2)[::2],
    "torch int32": lambda t: torch.tensor(t, dtype=torch.int32),
    "torch int64": lambda t: torch.tensor(t, dtype=torch.int64),
}


def _run_with(conv: Callable[[list[int]], object], page_size: int) -> list[object]:
    c = RadixCache(CacheConfig(128, page_size, record_events=True))
    out: list[object] = []
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    out.append(c.admit("a", conv(a)).slots.tolist())
    out.append(c.cache_unfinished("a", conv(a)))
    c.extend("a", 3)
    out.append(c.finish("a", conv([1, 2, 3])))
    m = c.match_prefix(conv([5, 6, 7, 8, 9, 10, 99]))
    out.append((m.prefix_len, m.slots.tolist()))
    s = c.alloc_slots(6)
    out.append(c.insert(conv([5, 6, 7, 8, 40, 41]), conv(s.tolist())))
    if page_size > 1:  # the partial last page stays the caller's
        first = int(s[-1]) // page_size * page_size
        c.free_slots(conv(list(range(first, first + page_size))))
    out.append(c.admit("b", conv([5, 6, 7, 8, 40, 41, 42])).slots.tolist())
    out.append(c.finish("b"))
    out.append(tree_nodes(c))
    out.append(c.take_events())
    out.append(c.digest())
    c.check_integrity()
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_every_key_type_gives_identical_results(page_size: int) -> None:
    results = {name: _run_with(conv, page_size) for name, conv in KEY_TYPES.items()}
    reference = results.pop("list")
    for name, got in results.items():
        assert got == reference, name


@pytest.mark.parametrize(
    "where",
    ["after the cached prefix", "in the partial last page", "where a cached node diverges"],
)
def test_a_negative_token_behind_a_cached_prefix_is_still_refused(where: str) -> None:
    # int32 keys are scanned for negatives only past the part that matched cached keys
    # (which were all checked when they came in): the rest must still be scanned.
    c, _ = _busy_cache()
    before = (snapshot(c), tree_nodes(c))
    key = {
        "after the cached prefix": [*P[:8], -5, 7, 8, 9, 10],
        "in the partial last page": [*P[:8], 1, -2],
        "where a cached node diverges": [*P[:4], P[4], -3, P[6], P[7], 1],
    }[where]
    arr = np.array(key, dtype=np.int32)
    for call in (lambda: c.match_prefix(arr), lambda: c.admit("new", arr)):
        with pytest.raises(InvalidTokens, match=">= 0"):
            call()
    assert (snapshot(c), tree_nodes(c)) == before
    c.check_integrity()


def test_joined_keys_hand_their_bytes_to_the_tree_once() -> None:
    a = np.arange(5, dtype=np.int32)
    b = np.arange(100, 103, dtype=np.int32)
    key = joined_key(a, b[1:])
    assert key.tolist() == [0, 1, 2, 3, 4, 101, 102]
    whole = key_bytes(key)
    assert whole is key.base and whole == key.tobytes()  # no second copy
    assert key_bytes(key[0:]) is whole  # a whole view of it too
    # Anything else is copied: a part, a reversed view, a plain array.
    assert key_bytes(key[2:]) == key[2:].tobytes() and key_bytes(key[2:]) is not whole
    assert key_bytes(key[::-1]) == key[::-1].tobytes()
    assert key_bytes(a) == a.tobytes()
    # A finished request's leaf holds exactly its tokens (prompt tail + output).
    cache = RadixCache(CacheConfig(64, 4))
    cache.admit(1, list(range(1, 11)))
    cache.extend(1, 2)
    cache.finish(1, [50, 51])
    assert cache.match_prefix([*range(1, 11), 50, 51, 9]).prefix_len == 12


def test_join_pages_equals_concatenate_in_a_new_writable_array() -> None:
    ring = np.arange(40, dtype=np.int64)
    parts = [ring[3:9], np.zeros(0, np.int64), ring[30:], np.array([7, -1], np.int64)]
    got = join_pages(parts)
    assert got.dtype == np.int64 and got.tolist() == np.concatenate(parts).tolist()
    assert got.flags.writeable and not any(np.shares_memory(got, p) for p in parts)
    got[0] = 99  # its own memory
    assert ring[3] == 3
    assert join_pages([]).tolist() == []
    # A long conversation's match joins one page array per node on its path.
    c = RadixCache(CacheConfig(256, 4))
    prompt = list(range(1, 65))
    for i in range(1, 5):
        c.admit(i, prompt[: 16 * i])
        c.finish(i)
    m = c.match_prefix([*prompt, 1])
    assert m.prefix_len == 64 and m.pages.tolist() == list(range(16))
    m.pages[:] = 0  # the caller's copy: the cache's pages stay
    assert c.match_prefix([*prompt, 1]).pages.tolist() == list(range(16))


def test_a_bool_id_is_refused_even_when_an_equal_int_id_is_running() -> None:
    # ReqTable.get finds exact int/str ids without re-checking them; True == 1 and hashes
    # like it, so it must not reach the running request 1.
    c = RadixCache(CacheConfig(64, 4))
    c.admit(1, [1, 2, 3, 4, 5])
    for call in (lambda: c.extend(True, 1), lambda: c.finish(True), lambda: c.abort(True)):
        with pytest.raises(CacheError, match="request id"):
            call()
    assert c.finish(1) == 4


def test_a_match_locked_by_a_failed_admit_is_evictable_again() -> None:
    # admit does not queue the end of its match (it locks it at once); when the
    # allocation then fails, unlock must queue it again with its new recency.
    c = RadixCache(CacheConfig(64, 4))
    c.admit("a", list(range(1, 9)))
    c.finish("a")
    c.admit("hold", list(range(200, 240)))  # 4 of 16 pages left free
    with pytest.raises(OutOfCapacity):
        c.admit("b", [*range(1, 9), *range(100, 120)], evict=lambda short: None)
    assert c.sizes().evictable == 8
    assert c.evict(8).num_tokens == 8
    c.check_integrity()


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 63, 64, 65, 200])
def test_min_value_and_int_sum_agree_with_numpy_on_both_sides_of_their_cut(n: int) -> None:
    seed = 1000 + n
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    for dtype in (np.int32, np.int64):
        arr = rng.integers(-(2**30), 2**30, size=n).astype(dtype)
        assert min_value(arr) == int(arr.min())
        assert int_sum(arr) == int(arr.astype(np.int64).sum())
        assert type(min_value(arr)) is int and type(int_sum(arr)) is int
    assert int_sum(np.zeros(0, np.int64)) == 0
