"""Block hashes and KV events: chained hashes, stores, removals (after splits too), clears."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from cache_helpers import fold_events, tree_block_index
from vllm_wire import VLLM_ARRAY_WIRE, OldCleared, OldRemoved, OldStored

from tpcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.tree import hashing
from tpcache.cache.tree.hashing import ROOT_STATE, PageHasher, block_hashes


def _cache(capacity: int = 256, page_size: int = 4, **kw: object) -> RadixCache:
    return RadixCache(CacheConfig(capacity, page_size, record_events=True, **kw))  # type: ignore[arg-type]


def _hashes(tokens: list[int], page_size: int) -> list[int]:
    h = PageHasher(page_size)
    return block_hashes(h.chain(np.array(tokens, np.int32), ROOT_STATE)).tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_stores_are_chained_and_name_their_parent(page_size: int) -> None:
    ps = page_size
    c = _cache(page_size=ps)
    a = list(range(1, 1 + 3 * ps))
    c.admit(0, [*a, *[5] * (ps - 1)])  # a partial last page is not stored
    c.finish(0)
    (ev,) = c.take_events()
    assert ev == BlockStored(
        block_hashes=_hashes(a, ps),
        parent_block_hash=None,
        token_ids=a,
        block_size=ps,
        medium="GPU",
    )
    b = [*a[: 2 * ps], *range(50, 50 + 2 * ps)]
    c.admit(1, b)
    c.finish(1)
    (ev2,) = c.take_events()
    # a block's hash covers its whole prefix: b's blocks after the shared ones are new,
    # and the first new block's parent is the last shared block
    full = _hashes(b, ps)
    assert full[:2] == ev.block_hashes[:2]
    assert ev2.block_hashes == full[2:]
    assert ev2.parent_block_hash == ev.block_hashes[1]
    assert ev2.token_ids == b[2 * ps :]


def test_the_same_page_under_another_prefix_has_another_hash() -> None:
    one = _hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    two = _hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert one[1] != two[1]
    assert _hashes([2, 1, 3, 4], 4) != _hashes([1, 2, 3, 4], 4)  # order matters
    assert _hashes([1, 2, 3], 1) != _hashes([1, 2, 4], 1)


def test_hashes_are_the_same_in_a_fresh_process_with_another_hash_seed() -> None:
    code = (
        "import numpy as np\n"
        "from tpcache.cache.tree.hashing import ROOT_STATE, PageHasher, block_hashes\n"
        "for ps in (1, 3, 4, 16):\n"
        "    t = np.arange(5, 5 + 4 * ps, dtype=np.int32)\n"
        "    print(block_hashes(PageHasher(ps).chain(t, ROOT_STATE)).tolist())\n"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in ("1", "2")
    ]
    here = "".join(f"{_hashes(list(range(5, 5 + 4 * ps)), ps)}\n" for ps in (1, 3, 4, 16))
    assert outs[0] == outs[1] == here


def test_hash_values_are_pinned() -> None:
    # Routers index blocks by these values: a change here breaks every consumer's index
    # across an upgrade, so it must be deliberate.
    assert _hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == _PINNED_PS4
    assert _hashes([1, 2], 1) == _PINNED_PS1


_PINNED_PS4 = [18038710463210700351, 12257923706368045701]
_PINNED_PS1 = [17470585212337158518, 10821751160836349517]


def test_removals_carry_the_stored_hashes_after_splits() -> None:
    c = _cache(page_size=2)
    a = list(range(1, 13))  # 6 pages
    c.admit(0, [*a, 0])
    c.finish(0)
    (stored,) = c.take_events()
    c.match_prefix(a[:4])  # split after page 2
    c.match_prefix(a[:8])  # split after page 4
    assert c.take_events() == []  # splits announce nothing
    removed: list[int] = []
    while c.tree.cached_pages:
        c.evict(1)
        (ev,) = c.take_events()
        assert isinstance(ev, BlockRemoved) and ev.medium == "GPU"
        removed.extend(ev.block_hashes)
    # leaves go first: the last two pages, then the middle, then the first
    assert removed == stored.block_hashes[4:] + stored.block_hashes[2:4] + stored.block_hashes[:2]


def test_duplicate_inserts_announce_nothing_and_folding_matches_the_tree() -> None:
    c = _cache(page_size=4)
    index: dict = {}
    p = list(range(1, 17))
    c.admit("a", p)
    c.admit("b", p)
    c.finish("a")
    c.finish("b")  # all its whole pages are already cached
    events = c.take_events()
    assert [type(e) for e in events] == [BlockStored]
    fold_events(index, events, 4)
    assert index == tree_block_index(c)
    c.evict(4)
    fold_events(index, c.take_events(), 4)
    assert index == tree_block_index(c)


def test_reset_announces_all_blocks_cleared_after_pending_events() -> None:
    c = _cache(page_size=1)
    c.admit(0, [1, 2, 3])
    c.finish(0)
    c.reset()
    events = c.take_events()
    assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]
    assert c.take_events() == []


def test_no_events_unless_recorded_and_medium_is_passed_through() -> None:
    c = RadixCache(CacheConfig(64, 1))
    c.admit(0, [1, 2, 3])
    c.finish(0)
    c.evict(64)
    c.reset()
    assert c.take_events() == []
    c = _cache(page_size=1, medium="CPU")
    c.admit(0, [1, 2, 3])
    c.finish(0)
    c.evict(64)
    stored, removed = c.take_events()
    assert stored.medium == removed.medium == "CPU"


def test_event_batches_round_trip_in_the_vllm_layout() -> None:
    c = _cache(page_size=2)
    c.admit(0, [1, 2, 3, 4, 5])
    c.finish(0)
    c.evict(2)
    batch = KVEventBatch(ts=1.5, events=[*c.take_events(), AllBlocksCleared()])
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch

    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[2] is None  # an array: [ts, events, data_parallel_rank]
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert raw[1][0]["parent_block_hash"] is None and raw[1][0]["block_size"] == 2
    assert all(0 <= h < 2**64 for h in raw[1][0]["block_hashes"])


def test_array_encoding_is_what_older_vllms_subscriber_structs_decode() -> None:
    c = _cache(page_size=2)
    c.admit(0, [1, 2, 3, 4, 5])
    c.finish(0)
    c.evict(2)
    named = BlockStored([7], 3, [1, 2], 2, lora_id=4, medium="CPU", lora_name="ad")
    batch = KVEventBatch(ts=2.5, events=[*c.take_events(), named, AllBlocksCleared()])
    payload = encode_batch(batch, "array")
    assert decode_batch(payload) == batch  # tpcache's own decoder reads both
    got = VLLM_ARRAY_WIRE.decode(payload)
    assert [type(e) for e in got.events] == [OldStored, OldRemoved, OldStored, OldCleared]
    stored = batch.events[0]
    assert got.events[0].block_hashes == stored.block_hashes
    assert got.events[0].token_ids == stored.token_ids and got.events[0].medium == "GPU"
    assert got.events[1].block_hashes == batch.events[1].block_hashes
    assert (got.events[2].lora_id, got.events[2].medium) == (4, "CPU")
    # The map encoding is the one such a decoder rejects.
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        VLLM_ARRAY_WIRE.decode(encode_batch(batch))
    with pytest.raises(ValueError, match="unknown event encoding"):
        encode_batch(batch, "json")
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [["NoSuchEvent", 1]], None]))


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_chain_follows_its_recurrence_page_by_page(page_size: int) -> None:
    # The vectorised chain must equal state[i] = state[i-1] * M + c[i] (mod 2**64),
    # computed here one page at a time with Python ints from the per-page words.
    seed = 1000 + page_size
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    h = PageHasher(page_size)
    key = rng.integers(0, 2**31 - 1, 37 * page_size).astype(np.int32)
    words = h.page_words(key).tolist()
    state, want = 0x1234_5678_9ABC_DEF0, []
    parent = state
    for c in words:
        state = (state * hashing.MULTIPLIER + c) & hashing.MASK64
        want.append(state)
    assert h.chain(key, parent).tolist() == want
    # and in two pieces, the second following the first's last state
    cut = 11 * page_size
    first = h.chain(key[:cut], parent)
    assert h.chain(key[cut:], int(first[-1])).tolist() == want[11:]
