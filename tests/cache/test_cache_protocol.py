"""Every cache kind implements ``Cache`` (``tpcache.cache.protocol``), its parts
``SwaPart`` and ``HostPart`` (``tpcache.cache.parts``) where it was built with them and
nowhere else, and the calls that replace upper layers' reaching into a cache's tree,
table or allocator answer exactly."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from swa_helpers import hybrid, run

from tpcache.cache.errors import CacheError, InvalidSlots, NoSwaPool, UnknownRequest
from tpcache.cache.events import AllBlocksCleared, BlockStored
from tpcache.cache.factory import CacheSpec, build
from tpcache.cache.keys import pages_to_slots
from tpcache.cache.parts import HostPart, SwaPart
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.records import CacheStats

R = lambda a, b: list(range(a, b + 1))  # noqa: E731


def _base() -> RadixCache:
    return RadixCache(CacheConfig(64, 4, record_events=True))


def _host() -> Cache:
    return build(CacheSpec(page_size=4, host_capacity_tokens=64), 64)


def _members(protocol: type) -> list[str]:
    names = [n for n in vars(protocol) if not n.startswith("_")]
    return sorted({*names, *protocol.__annotations__})


def _check_members(protocol: type, obj: object) -> None:
    for name in _members(protocol):
        assert hasattr(obj, name), name
        want = vars(protocol).get(name)
        if inspect.isfunction(want):
            got = inspect.signature(getattr(type(obj), name))
            params = [(p.name, p.kind, p.default) for p in got.parameters.values()]
            expected = [
                (p.name, p.kind, p.default) for p in inspect.signature(want).parameters.values()
            ]
            assert params == expected, name


KINDS = [_base, lambda: hybrid(64, 64, 8, 4), _host]


@pytest.mark.parametrize("make", KINDS, ids=["base", "hybrid", "host"])
def test_every_protocol_member_is_there_with_its_signature(make) -> None:
    cache = make()
    _check_members(Cache, cache)
    for part, protocol in ((cache.swa, SwaPart), (cache.host, HostPart)):
        if part is not None:
            _check_members(protocol, part)


@pytest.mark.parametrize("make", KINDS, ids=["base", "hybrid", "host"])
def test_a_cache_has_the_parts_it_was_built_with_and_none_of_the_others_calls(make) -> None:
    """The window and the host tier are parts, not calls every cache answers: a cache
    built without one has ``None`` there and none of its calls."""
    c = make()
    built = {"swa": c.swa is not None, "host": c.host is not None}
    assert built == {"swa": make is KINDS[1], "host": make is KINDS[2]}
    own = {n for n in dir(c) if not n.startswith("_")}
    for part, protocol in (("swa", SwaPart), ("host", HostPart)):
        assert not own & set(_members(protocol)) - set(_members(Cache)), part
    for name in ("window", "swa_slots", "request_swa_slots", "host_tier", "host_sizes"):
        assert not hasattr(c, name), name


def test_kinds_differ_by_data() -> None:
    b, h = _base(), hybrid(64, 32, 8, 4)
    assert (b.pool_names, b.num_pools, b.swa) == (("full",), 1, None)
    assert (h.pool_names, h.num_pools) == (("full", "SWA"), 2)
    assert h.swa is not None and h.swa.window == 8
    assert [p.capacity for p in h.pool_sizes()] == [64, 32]
    assert b.evictable_pages() == (0,) and h.evictable_pages() == (0, 0)


@pytest.mark.parametrize("make", [_base, lambda: hybrid(64, 64, 8, 4)], ids=["base", "hybrid"])
def test_is_running_never_raises(make) -> None:
    c = make()
    c.admit("a", R(1, 9))
    c.admit(7, R(1, 5))
    assert c.is_running("a") and c.is_running(np.str_("a")) and c.is_running(7)
    for rid in ("b", 8, True, "", 2**70, [1], None, 1.0):
        assert not c.is_running(rid), rid
    c.finish("a")
    assert not c.is_running("a")
    assert c.running_ids() == [7]


def test_request_row_slots() -> None:
    c = _base()
    c.admit("a", R(1, 9), reserve=2)
    row = c.request_row("a")
    assert row.slots.tolist() == pages_to_slots(row.pages, 4, 11).tolist() == R(0, 10)


def test_request_swa_slots_is_the_window_the_first_new_token_sees() -> None:
    h = hybrid(36, 32, 4, 4)  # 9 full pages, 8 SWA pages
    swa = h.swa
    assert swa is not None
    with pytest.raises(UnknownRequest):
        swa.request_slots("z", 0)
    run(h, "p", R(101, 108))
    run(h, "q", [*R(101, 104), *R(201, 204)])
    h.lock(h.match_prefix(R(101, 108)).handle)
    h.lock(h.match_prefix([*R(101, 104), *R(201, 204)]).handle)
    assert h.evict(0, 1).tombstoned == 1  # [101..104] frees its SWA page only
    run(h, "x", R(1, 16))
    assert h.admit("a", [*R(1, 16), 40, 41]).prefix_len == 16
    h.extend("a", 4)
    row = h.request_row("a")
    assert row.pages.tolist() == [3, 4, 5, 6, 7, 8]
    assert swa.slots(row.slots[16:]).tolist() == [28, 29, 30, 31, 0, 1]  # SWA page 0 again
    for start in (0, 3, 16, 18, 22):
        swa_start, slots = swa.request_slots("a", start)
        assert swa_start == max(0, start - 4)
        assert slots.tolist() == swa.slots(row.slots[swa_start:]).tolist()
    with pytest.raises(InvalidSlots):
        swa.request_slots("a", 23)
    with pytest.raises(InvalidSlots):
        swa.request_slots("a", -1)
    with pytest.raises(InvalidSlots):
        swa.slots([10_000])


def test_tombstoned_pages_of_a_match() -> None:
    h = hybrid(64, 64, 4, 1)
    run(h, "a", R(1, 10))
    run(h, "b", [*R(1, 6), *R(20, 23)])
    h.lock(h.match_prefix(R(1, 10)).handle)
    h.lock(h.match_prefix([*R(1, 6), *R(20, 23)]).handle)
    assert h.evict(0, 1).tombstoned == 1  # [1..6] keeps its full KV only
    got = h.match_prefix(R(1, 10))
    assert got.prefix_len == 10
    assert h.swa is not None
    assert h.swa.tombstoned_pages(got.pages) == 6
    assert h.swa.tombstoned_pages(got.pages[6:]) == 0
    with pytest.raises(InvalidSlots):
        h.swa.tombstoned_pages([64])
    assert h.stats().tombstoned_nodes == 1


@pytest.mark.parametrize("make", [_base, lambda: hybrid(64, 64, 8, 4)], ids=["base", "hybrid"])
def test_stats_and_evict_seconds(make) -> None:
    c = make()
    pools = c.num_pools
    assert c.stats() == CacheStats(0, (0,) * pools, 0)
    run(c, "a", R(1, 20))
    run(c, "b", R(30, 50))
    c.evict(8)
    c.evict(0)
    s = c.stats()
    assert s.evict_calls == 2 and s.evicted_pages == c.eviction_marks()
    assert s.evicted_pages[0] >= 2
    assert len(c.evict_seconds()) == 2 and len(c.evict_seconds(1)) == 1
    assert c.evict_seconds(0) == [] and len(c.evict_seconds(5)) == 2
    with pytest.raises(CacheError):
        c.evict_seconds(-1)


def test_swa_tokens_need_an_swa_pool() -> None:
    c = _base()
    run(c, "a", R(1, 20))
    before = (c.digest(), c.sizes())
    with pytest.raises(NoSwaPool):
        c.evict(4, 4)
    assert (c.digest(), c.sizes()) == before
    assert c.evict(4, 0).num_tokens == 20  # the whole leaf


def test_events_move_to_the_cache_that_replaces_another() -> None:
    old = _base()
    run(old, "a", R(1, 8))
    old.take_events()
    old.reset()
    new = _base()
    run(new, "b", R(1, 4))
    new.put_back_events(old.take_events())
    events = new.take_events()
    assert events[0] == AllBlocksCleared() and isinstance(events[1], BlockStored)
    assert len(events) == 2 and new.take_events() == []
