"""Namespaces (LoRA adapters, cache salts) in the host-tier cache: equal tokens in two
namespaces never share KV on either tier, an anchor lives exactly while something is
cached below it on either tier, a load under an anchor locks as a walk would, host
copies announce their adapter, and a lockstep of random calls in several namespaces
keeps every check."""

from __future__ import annotations

import random

import pytest
from ns_helpers import ns_view

from tpcache.cache.errors import InvalidNamespace, InvalidSlots
from tpcache.cache.events import BlockRemoved, BlockStored
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.cache.namespace import CacheNamespace, is_anchor

A = CacheNamespace(salt="tenant-a")
B = CacheNamespace(lora_id=3, lora_name="sql")


def blocks(ps: int, *ids: int) -> list[int]:
    """Whole pages of distinct tokens: page ``i`` is ``100 * i + 1 ..``."""
    return [100 * i + j + 1 for i in ids for j in range(ps)]


def make(ps: int, dev: int = 4, host: int = 8, **kw: object) -> HostCache:
    cfg = HostConfig(dev * ps, ps, host_capacity_tokens=host * ps, record_events=True, **kw)  # type: ignore[arg-type]
    return HostCache(cfg)


def run(cache: HostCache, rid: object, tokens: list[int], space=None):  # type: ignore[no-untyped-def]
    got = cache.admit(rid, tokens, namespace=space)
    cache.check_integrity()
    cache.finish(rid)
    cache.check_integrity()
    return got


def anchors(cache: HostCache) -> int:
    return sum(1 for n in cache.tree.walk() if is_anchor(n))


def anchor_lock(cache: HostCache) -> int:
    (lock,) = [v[-1] for v in ns_view(cache) if v[0] == "anchor"]
    return lock


def tiers(cache: HostCache) -> list[tuple[int, bool]]:
    """(first token, on the device) of every node but the anchors, by first token."""
    return sorted((int(n.key[0]), n.dev) for n in cache.tree.walk() if not is_anchor(n))


@pytest.mark.parametrize("ps", [1, 16])
def test_equal_tokens_share_nothing_across_namespaces_on_either_tier(ps: int) -> None:
    c = make(ps)
    p = blocks(ps, 1, 2, 3)
    run(c, 1, p, A)
    run(c, 2, blocks(ps, 5, 6, 7))  # A's pages go to the host
    assert tiers(c) == [(101, False), (501, True)]
    assert c.admit_prefix_len(p, A) == 2 * ps  # whole pages of p[:-1], loaded back
    assert c.admit_prefix_len(p) == 0 and c.admit_prefix_len(p, B) == 0
    assert c.match_prefix(p, B).host_hit_length == 0
    got = run(c, 3, p, B)  # B computes its own: no hit on A's host copy
    assert (got.prefix_len, got.host_hit_length) == (0, 0)
    got = run(c, 4, p, A)  # A loads its own back
    assert (got.prefix_len, got.host_hit_length) == (2 * ps, 2 * ps)
    got = run(c, 5, p)  # the default namespace has none of it
    assert got.prefix_len == 0
    assert anchors(c) == 2


def test_an_anchor_goes_with_its_last_host_leaf() -> None:
    """A's only prefix moves to the host, then the host pool drops it: A's anchor goes
    at that moment, and the tree, counters and digest terms check out at each step."""
    c = make(1, dev=4, host=4)
    run(c, 1, blocks(1, 1, 2, 3), A)
    assert anchor_lock(c) == 1
    run(c, 2, blocks(1, 4, 5, 6, 7))  # A's 3 pages to the host
    assert anchors(c) == 1 and c.host.sizes().evictable == 3
    run(c, 3, blocks(1, 8, 9, 10, 11))  # the default prefix to the host: A's is dropped
    assert c.host.counts()["host_evicted_pages"] >= 3
    assert anchors(c) == 0 and not c.tree.spaces
    assert c.admit_prefix_len(blocks(1, 1, 2, 3), A) == 0
    run(c, 4, blocks(1, 1, 2, 3), A)  # a new anchor, as for a namespace never seen
    assert anchors(c) == 1


def test_an_anchor_goes_when_its_device_node_is_dropped_without_host_room() -> None:
    """Write-through keeps no write-back: an evicted node without a host copy is deleted,
    its namespace's anchor with it."""
    c = make(1, dev=4, host=4, write_policy="write_through_selective", write_through_hits=5)
    run(c, 1, blocks(1, 1, 2, 3), A)
    run(c, 2, blocks(1, 4, 5, 6, 7))
    assert anchors(c) == 0 and not c.tree.spaces
    assert c.host.sizes().cached == 0


def test_a_load_under_an_anchor_locks_as_a_walk_would() -> None:
    """Nothing of A's prompt is on the device: the admit loads the host path below A's
    anchor; while it runs, the anchor's lock counts the request (the integrity check
    compares it with its children's), and finish and abort give it back."""
    c = make(2, dev=4, host=8)
    p = blocks(2, 1, 2, 3)
    run(c, 1, p, A)
    run(c, 2, blocks(2, 5, 6, 7))
    got = c.admit(3, p, namespace=A)
    assert got.host_hit_length == 4 and got.prefix_len == 4
    c.check_integrity()  # the anchor's lock: its base lock + the loaded child's
    assert anchor_lock(c) == 2
    c.abort(3)
    c.check_integrity()
    assert anchor_lock(c) == 1
    got = c.admit(4, p, namespace=A)  # on the device now: an ordinary hit
    assert (got.prefix_len, got.host_hit_length) == (4, 0)
    c.finish(4)
    c.check_integrity()


def test_host_copies_announce_their_adapter_per_medium() -> None:
    c = make(2, dev=4, host=8)
    run(c, 1, blocks(2, 1, 2, 3), B)
    run(c, 2, blocks(2, 5, 6, 7))
    events = c.take_events()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [(e.lora_id, e.lora_name, e.token_ids) for e in cpu] == [(3, "sql", blocks(2, 1, 2, 3))]
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu[0].lora_id == 3 and gpu[0].block_hashes == cpu[0].block_hashes
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [("GPU", cpu[0].block_hashes)]


def test_a_lent_insert_in_a_namespace_revives_its_host_nodes() -> None:
    """A caller's pages for tokens A holds on the host only: the insert gives the host
    nodes those pages, below A's anchor, and A then hits them on the device."""
    c = make(2, dev=8, host=8)
    p = blocks(2, 1, 2)
    run(c, 1, [*p, 9], A)
    assert c.evict(4).num_tokens == 4  # A's 2 pages (the only ones cached) to the host
    assert c.match_prefix([*p, 9], A).host_hit_length == 4
    slots = c.alloc_slots(4)
    assert c.insert(p, slots, namespace=A) == 4
    c.check_integrity()
    got = c.admit(3, [*p, 9], namespace=A)
    assert (got.prefix_len, got.host_hit_length) == (4, 0)
    assert got.pages[:2].tolist() == (slots[::2] // 2).tolist()
    c.finish(3)
    c.check_integrity()


def test_a_lent_insert_of_pages_not_lent_makes_no_anchor() -> None:
    """Pages the caller was not lent, for a namespace with nothing cached yet: refused
    (``InvalidSlots``) before its anchor is made; nothing changes."""
    c = make(2, dev=8, host=8)
    run(c, 1, blocks(2, 1, 2), A)
    c.evict(4)  # something host-only, so the insert's host checks run too
    held = c.admit(2, blocks(2, 5, 6))  # pages a request holds, not the caller's
    before = (c.digest(), ns_view(c), c.sizes())
    with pytest.raises(InvalidSlots):
        c.insert(blocks(2, 5, 6), held.slots, namespace=B)
    assert (c.digest(), ns_view(c), c.sizes()) == before and anchors(c) == 1
    c.abort(2)
    c.check_integrity()


def test_a_bad_namespace_changes_nothing() -> None:
    c = make(2)
    run(c, 1, blocks(2, 1, 2), A)
    before = (c.digest(), ns_view(c))
    for bad in ("tenant-a", {"salt": "a"}, 7):
        with pytest.raises(InvalidNamespace):
            c.admit(9, blocks(2, 1, 2), namespace=bad)
        with pytest.raises(InvalidNamespace):
            c.match_prefix(blocks(2, 1, 2), bad)
        with pytest.raises(InvalidNamespace):
            c.admit_prefix_len(blocks(2, 1, 2), bad)
    assert (c.digest(), ns_view(c)) == before and c.running_ids() == []


def test_random_calls_in_several_namespaces_keep_every_check() -> None:
    """Admit, extend, cache_unfinished, finish and abort in three namespaces over small
    pools (every admit evicts, the host pool drops): after every call the integrity check
    holds, and no request ever matches more than its own namespace ever cached."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ps = 2
    c = make(ps, dev=12, host=16)
    spaces = [None, A, B]
    heads = [[rng.randrange(1, 40) for _ in range(6)] for _ in range(4)]
    seen: dict[object, set[tuple[int, ...]]] = {s: set() for s in spaces}
    running: dict[int, tuple[object, list[int]]] = {}
    for rid in range(300):
        if running and (len(running) > 2 or rng.random() < 0.4):
            r = rng.choice(sorted(running))
            space, tokens = running.pop(r)
            if rng.random() < 0.2:
                c.abort(r)
            else:
                c.finish(r)
                n = len(tokens) // ps * ps
                seen[space].update(tuple(tokens[:k]) for k in range(ps, n + 1, ps))
        else:
            space = rng.choice(spaces)
            tokens = rng.choice(heads)[: rng.randrange(1, 7)] + [
                rng.randrange(1, 40) for _ in range(rng.randrange(1, 4))
            ]
            try:
                got = c.admit(rid, tokens, namespace=space)
            except Exception as exc:  # out of room with everything held: refused whole
                assert type(exc).__name__ == "OutOfCapacity", exc
                c.check_integrity()
                continue
            if got.prefix_len:
                assert tuple(tokens[: got.prefix_len]) in seen[space], (rid, space)
            if rng.random() < 0.3:
                c.cache_unfinished(rid, tokens)
                n = len(tokens) // ps * ps
                seen[space].update(tuple(tokens[:k]) for k in range(ps, n + 1, ps))
            running[rid] = (space, tokens)
        c.check_integrity()
    for r in sorted(running):
        c.finish(r)
    c.check_integrity()
    assert c.host.counts()["written_pages"] > 0 and c.host.counts()["loaded_pages"] > 0
