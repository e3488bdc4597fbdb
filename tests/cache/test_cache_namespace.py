"""Cache namespaces: equal tokens under another LoRA adapter or tenant salt never
share KV; anchors live exactly while they have children; events carry the adapter."""

from __future__ import annotations

import random
import re

import msgspec
import pytest
from cache_helpers import snapshot
from ns_helpers import ns_view, run_in
from swa_helpers import hybrid, pools
from vllm_wire import VLLM_ARRAY_WIRE

from tpcache.cache.errors import CacheError, IntegrityError, InvalidNamespace, InvalidSlots
from tpcache.cache.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tpcache.cache.namespace import CacheNamespace, make_namespace
from tpcache.cache.radix import CacheConfig, RadixCache

A = CacheNamespace(salt="tenant-a")
B = CacheNamespace(lora_id=3, lora_name="sql-adapter")


def R(a: int, b: int) -> list[int]:
    return list(range(a, b + 1))


def _cache(capacity: int = 64, page_size: int = 2, **kw: object) -> RadixCache:
    return RadixCache(CacheConfig(capacity, page_size, record_events=True, **kw))  # type: ignore[arg-type]


def test_equal_tokens_in_two_namespaces_are_cached_apart() -> None:
    c = _cache()
    assert [run_in(c, i, R(1, 9), s) for i, s in enumerate((None, A, B, A, None))] == [
        0, 0, 0, 8, 8,
    ]  # fmt: skip
    assert ns_view(c) == [
        (R(1, 8), [0, 1, 2, 3], 0),
        ("anchor", None, None, "tenant-a", 1),
        (R(1, 8), [5, 6, 7, 8], 0),
        ("anchor", 3, "sql-adapter", None, 1),
        (R(1, 8), [10, 11, 12, 13], 0),
    ]
    # A running request locks its path and its namespace's anchor (base lock 1 + 1).
    c.admit("x", [*R(1, 4), 50], namespace=B)
    assert ns_view(c)[3:] == [
        ("anchor", 3, "sql-adapter", None, 2),
        (R(1, 4), [10, 11], 1),
        ([5, 6, 7, 8], [12, 13], 0),
    ]
    assert c.admit_prefix_len(R(1, 9), A) == 8
    assert c.admit_prefix_len(R(1, 9), CacheNamespace(salt="nobody")) == 0
    c.check_integrity()


def test_the_default_namespace_is_the_root_and_leaves_digests_unchanged() -> None:
    plain, named = _cache(), _cache()
    run_in(plain, 0, R(1, 9))
    run_in(named, 0, R(1, 9), CacheNamespace())  # all fields None: the default one
    assert plain.digest() == named.digest() and not named.tree.spaces
    assert make_namespace() is None and make_namespace(salt="s") == CacheNamespace(salt="s")


def test_eviction_deletes_an_anchor_with_its_last_child() -> None:
    c = _cache(capacity=16)
    run_in(c, 0, R(1, 9), A)
    run_in(c, 1, [*R(1, 4), 40, 41, 42], A)
    assert ns_view(c) == [
        ("anchor", None, None, "tenant-a", 1),
        (R(1, 4), [0, 1], 0),
        ([5, 6, 7, 8], [2, 3], 0),
        ([40, 41], [5], 0),
    ]
    assert c.evict(2).num_tokens == 4  # [5..8], the older leaf, goes whole
    c.check_integrity()
    assert c.evict(2).num_tokens == 2  # [40, 41]; [1..4] keeps the anchor alive
    assert ns_view(c) == [("anchor", None, None, "tenant-a", 1), (R(1, 4), [0, 1], 0)]
    c.take_events()
    got = c.evict(100)
    assert (got.num_tokens, got.num_nodes) == (4, 1)  # the anchor is no evicted node
    assert ns_view(c) == [] and c.tree.spaces == {} and list(c.tree.nodes) == [0]
    assert c.sizes().free == 16
    assert len(c.take_events()) == 1  # the block's removal; none for the anchor
    c.check_integrity()


def test_events_carry_the_adapter_and_hashes_differ_across_namespaces() -> None:
    c = _cache()
    for i, s in enumerate((None, A, B)):
        run_in(c, i, R(1, 5), s)
    stored = c.take_events()
    assert [(e.lora_id, e.lora_name, e.parent_block_hash, e.token_ids) for e in stored] == [
        (None, None, None, R(1, 4)),
        (None, None, None, R(1, 4)),  # the salt is never announced
        (3, "sql-adapter", None, R(1, 4)),
    ]
    hashes = [tuple(e.block_hashes) for e in stored]
    assert len(set(hashes)) == 3 and len({h for hs in hashes for h in hs}) == 6
    c.evict(100)
    removed = c.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(tuple(e.block_hashes) for e in removed) == sorted(hashes)
    # Below an anchor a store names its parent block like anywhere else.
    run_in(c, 9, R(1, 5), B)
    run_in(c, 10, [*R(1, 4), 7, 7, 7], B)
    first, second = c.take_events()
    assert isinstance(second, BlockStored) and second.lora_id == 3
    assert second.parent_block_hash == first.block_hashes[-1]


BAD = [
    ("salt", 5, "salt must be a str or None, got int"),
    ("salt", "", "salt must have 1 to 256 characters, got 0"),
    ("salt", "s" * 257, "salt must have 1 to 256 characters, got 257"),
    ("lora_id", -1, "lora_id must be in [0, 2**63), got -1"),
    ("lora_id", 1 << 63, "lora_id must be in [0, 2**63)"),
    ("lora_id", True, "lora_id must be an int or None, got bool"),
    ("lora_id", "3", "lora_id must be an int or None, got str"),
    ("lora_name", b"x", "lora_name must be a str or None, got bytes"),
]


@pytest.mark.parametrize(("field", "value", "msg"), BAD)
def test_a_bad_namespace_field_is_a_typed_error(field: str, value: object, msg: str) -> None:
    with pytest.raises(InvalidNamespace, match=re.escape(msg)):
        CacheNamespace(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["tenant-a", {"salt": "a"}, ("a",), 7])
def test_a_bad_namespace_changes_nothing(bad: object) -> None:
    c = _cache()
    run_in(c, 0, R(1, 9), A)
    c.admit("held", R(1, 5), namespace=A)
    before = (snapshot(c), ns_view(c), c.running_ids())
    with pytest.raises(InvalidNamespace, match="a namespace must be a CacheNamespace or None"):
        c.admit("new", R(1, 9), namespace=bad)
    with pytest.raises(InvalidNamespace):
        c.admit_prefix_len(R(1, 9), bad)
    assert (snapshot(c), ns_view(c), c.running_ids()) == before
    assert isinstance(InvalidNamespace("x"), CacheError)


def test_chunked_prefill_and_abort_stay_in_the_namespace() -> None:
    c = _cache()
    c.admit("p", R(1, 5), namespace=A)
    assert c.cache_unfinished("p", R(1, 5)) == 4  # makes A's anchor, locks below it
    assert ns_view(c) == [("anchor", None, None, "tenant-a", 2), (R(1, 4), [0, 1], 1)]
    assert c.admit_prefix_len(R(1, 9)) == 0 and c.admit_prefix_len(R(1, 9), A) == 4
    c.abort("p")
    assert ns_view(c) == [("anchor", None, None, "tenant-a", 1), (R(1, 4), [0, 1], 0)]
    c.admit("q", [1], namespace=B)  # nothing cached: no anchor for B
    c.finish("q")
    assert len(c.tree.spaces) == 1
    c.check_integrity()


def test_integrity_check_catches_a_broken_anchor() -> None:
    c = _cache()
    run_in(c, 0, R(1, 9), A)
    anchor = c.tree.anchor_node = c.tree.root.children[A.key]
    anchor.lock += 1
    with pytest.raises(IntegrityError, match=r"anchor \d+ has lock 2, want 1"):
        c.check_integrity()
    anchor.lock -= 1
    c.tree.spaces.clear()
    with pytest.raises(IntegrityError, match="not a known namespace's"):
        c.check_integrity()


def test_a_sliding_window_cascade_deletes_the_anchor() -> None:
    # anchor -> T(1..6, tombstoned) -> B(7, 8) -> {C(9, 10), E(20, 21)}; window 4.
    c = hybrid(64, 64, window=4)
    run_in(c, "c", R(1, 10), A)
    run_in(c, "e", [*R(1, 8), 20, 21], A)
    c.admit("t", [*R(1, 6), 99], namespace=A)  # splits [1..8] at 6
    c.abort("t")
    c.admit("hc", [*R(1, 10), 99], namespace=A)
    c.admit("he", [*R(1, 8), 20, 21, 99], namespace=A)
    assert c.evict(0, 1).swa_tokens == 6  # T: its SWA KV is not in a locked window
    assert c.tree.tombstones == 1
    c.abort("hc")
    c.abort("he")
    c.check_integrity()
    c.take_events()
    c.evict(1)  # one leaf; its sibling keeps B
    assert len(c.tree.spaces) == 1
    c.evict(1)  # the other: B follows a tombstone too closely, T may not be a leaf
    assert c.tree.spaces == {} and list(c.tree.nodes) == [0]
    # C, E, B; T was announced removed when it was tombstoned.
    assert [len(e.block_hashes) for e in c.take_events()] == [2, 2, 2]
    assert pools(c) == ((64, 0, 0, 0), (64, 0, 0, 0), 0, 0)
    c.check_integrity()


@pytest.mark.parametrize("kind", ["radix", "hybrid"])
def test_random_namespaced_ops_are_deterministic_and_isolated(kind: str) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    spaces = [None, A, B, CacheNamespace(lora_id=3)]

    def make() -> object:
        if kind == "radix":
            return _cache(capacity=48, page_size=2)
        return hybrid(48, 40, window=4, page_size=2)

    caches = [make(), make()]
    # A reference per namespace: its requests alone, in a cache that never evicts.
    alone = {i: _cache(capacity=1 << 14, page_size=2) for i in range(len(spaces))}
    big = _cache(capacity=1 << 14, page_size=2)
    drops = 0  # anchors an eviction deleted
    for step in range(300):
        had = len(caches[0].tree.spaces)
        s = rng.randrange(len(spaces))
        toks = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 12))]
        got = [run_in(c, step, toks, spaces[s]) for c in caches]
        want = run_in(alone[s], step, toks)
        assert got[0] == got[1] and got[0] <= want
        assert run_in(big, step, toks, spaces[s]) == want  # no eviction: exactly alone's
        if rng.random() < 0.1:
            n = rng.randrange(1, 20)
            for c in caches:
                c.evict(n)
        assert caches[0].digest() == caches[1].digest()
        caches[0].check_integrity()
        drops += len(caches[0].tree.spaces) < had
    big.check_integrity()
    assert len(big.tree.spaces) == 3 and drops > 0


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_namespaced_events_survive_both_wire_encodings(encoding: str) -> None:
    c = _cache()
    run_in(c, 0, R(1, 5), B)
    events = c.take_events()
    payload = encode_batch(KVEventBatch(1.0, events, None), encoding)
    back = decode_batch(payload).events  # lora_id and lora_name come back
    assert events[0].namespace is not None  # tpcache's extension field: maps only
    if encoding == "map":
        assert back == events
    else:  # older vLLM's subscriber layout: lora_id, no lora_name
        assert back == [msgspec.structs.replace(events[0], namespace=None)]
        (ev,) = VLLM_ARRAY_WIRE.decode(payload).events
        assert (ev.lora_id, ev.block_hashes) == (3, events[0].block_hashes)


@pytest.mark.parametrize("make", [_cache, lambda: hybrid(64, 64, window=4, page_size=2)])
def test_match_prefix_and_insert_take_a_namespace(make) -> None:
    c = make()
    slots = c.alloc_slots(8)
    assert c.insert(R(1, 8), slots, namespace=A) == 0
    assert c.match_prefix(R(1, 9)).prefix_len == 0  # not in the default namespace
    got = c.match_prefix(R(1, 9), A)
    assert got.prefix_len == 8 and got.pages.tolist() == (slots[::2] // 2).tolist()
    c.lock(got.handle)
    assert c.evict(100).num_tokens == 0  # the handle keeps the path and the anchor
    c.check_integrity()
    c.unlock(got.handle)
    # A refused insert (slots not lent) makes no anchor, takes no node id.
    before = (snapshot(c), ns_view(c), c.tree.next_node_id)
    with pytest.raises(InvalidSlots, match="cannot insert"):
        c.insert(R(1, 4), [40, 41, 42, 43], namespace=B)
    with pytest.raises(InvalidNamespace):
        c.match_prefix(R(1, 9), "A")
    assert (snapshot(c), ns_view(c), c.tree.next_node_id) == before
    c.evict(100)
    assert c.tree.spaces == {} and c.sizes().free == 64
    c.check_integrity()
