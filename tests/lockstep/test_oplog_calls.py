"""The mirror's logged calls (``lockstep.oplog``) and their fast paths: the op a rank gets is
the same bytes whatever form the caller's tokens take, and a rank that applies the ops
ends where the mirror is."""

from __future__ import annotations

import numpy as np
import pytest

from tpcache.cache.allocator import CACHED, FREE, HELD, PageAllocator
from tpcache.cache.errors import CacheError, DuplicateRequest, InvalidTokens
from tpcache.cache.keys import frozen_tokens
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.lockstep.oplog import logged_admit, logged_finish
from tpcache.lockstep.ops import CopiesDone, Finish, OpResult, pack_tokens
from tpcache.workers.protocol import apply_op, local_evict


def _cache() -> RadixCache:
    return RadixCache(CacheConfig(capacity_tokens=64, page_size=4))


PROMPT = list(range(1, 12))


@pytest.mark.parametrize(
    "tokens",
    [
        PROMPT,
        np.array(PROMPT, np.int32),
        np.array(PROMPT, np.int64),
        np.array([*PROMPT, 0], np.int32)[:-1],
        np.array(PROMPT[::-1], np.int32)[::-1],  # not contiguous
        frozen_tokens(PROMPT),
    ],
    ids=["list", "int32", "int64", "view", "strided", "frozen"],
)
def test_the_admit_op_carries_the_checked_int32_tokens_whatever_their_form(tokens) -> None:
    mirror = _cache()
    got, op, expected = logged_admit(mirror, "a", tokens, 0, 2, None)
    assert op.tokens == pack_tokens(np.array(PROMPT, np.int32))
    assert got.prefix_len == 0 and expected.num_slots == 13


def test_a_refused_admit_logs_nothing_and_keeps_its_error() -> None:
    mirror = _cache()
    logged_admit(mirror, "a", PROMPT, 0, 0, None)
    with pytest.raises(DuplicateRequest):
        logged_admit(mirror, "a", np.array([-1, 2], np.int32), 0, 0, None)
    with pytest.raises(InvalidTokens):
        logged_admit(mirror, "b", np.array([1, -2], np.int32), 0, 0, None)
    assert mirror.running_ids() == ["a"]


def test_finish_sends_only_the_outputs_with_slots_and_a_rank_ends_as_the_mirror() -> None:
    mirror, rank = _cache(), _cache()
    evict = local_evict(rank)
    ops = []
    for rid, reserve in (("a", 2), ("b", 0)):
        _, op, expected = logged_admit(mirror, rid, PROMPT, 0, reserve, None)
        assert apply_op(rank, op, evict) == expected
        ops.append(op)
    n, op, expected = logged_finish(mirror, "a", [20, 21, 22, 23, 24])
    assert n == 12 and op == Finish("a", pack_tokens(np.array([20, 21], np.int32)))
    assert apply_op(rank, op, evict) == expected
    n, op, expected = logged_finish(mirror, "b", np.array([30, 31], np.int32))
    assert n == 8 and op.output == b""  # no slot past the prompt: nothing to send
    assert apply_op(rank, op, evict) == expected
    assert rank.digest() == mirror.digest()
    rank.check_integrity()
    with pytest.raises(InvalidTokens):  # validated before anything changes
        logged_finish(mirror, "a", [-1])


def test_one_page_tag_moves_show_in_the_numpy_tags() -> None:
    alloc = PageAllocator(8, 4)
    page = alloc.alloc(1, HELD)
    assert alloc.tags_of(page).tolist() == [HELD]
    alloc.retag(page, HELD, CACHED, checked=False)
    assert alloc.tags_of(page).tolist() == [CACHED]
    alloc.free(page, CACHED, checked=False)
    assert alloc.tags_of(page).tolist() == [FREE]
    alloc.check_integrity()
    pages = alloc.alloc(8, HELD)
    assert pages.tolist() == [1, 2, 3, 4, 5, 6, 7, 0]  # the FIFO wraps: a new array
    assert (alloc.tags_of(pages) == HELD).all()
    alloc.check_integrity()


def test_a_copies_done_op_on_a_cache_without_a_host_tier_is_refused_unless_zero() -> None:
    """A cache built without a host tier has no copy log (``cache.host`` is None): only
    the count it has, 0, can be done."""
    rank = _cache()
    rank.admit("a", PROMPT)
    digest = rank.digest()
    assert rank.host is None
    assert apply_op(rank, CopiesDone(0), local_evict(rank)) == OpResult()
    with pytest.raises(CacheError, match="starts no copies: 1 cannot be done"):
        apply_op(rank, CopiesDone(1), local_evict(rank))
    assert rank.digest() == digest
