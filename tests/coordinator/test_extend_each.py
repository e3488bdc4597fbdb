"""``Coordinator.extend_each``: a decode step's extends in one call. The same slots and
ops as one ``extend`` per request (every rank's digest equals the mirror's after it);
it stops at the first request the cache has no room for, and raises on a bad id with
the requests before it extended."""

from __future__ import annotations

import pytest
from group_helpers import PAGE, group_config

from tpcache.cache.errors import CacheError, UnknownRequest
from tpcache.coordinator.local_ranks import start_local_group


@pytest.fixture(scope="module")
def coord():
    c = start_local_group(group_config(2, capacity_tokens=64))
    yield c
    c.close()


def _rows(c, rids):
    return {r: c.mirror.request_row(r).num_tokens for r in rids}


def test_it_extends_each_in_order_as_extend_would(coord) -> None:
    coord.reset()
    for r in ("a", "b", "c"):
        coord.admit(r, [1, 2, 3] if r != "b" else [4, 5])
    assert coord.extend_each(["a", "b", "c"], 2) == 3
    assert _rows(coord, "abc") == {"a": 5, "b": 4, "c": 5}
    coord.sync()
    assert [i["digest"] for i in coord.ranks.call("info")] == [coord.mirror.digest()] * 2
    for r in "abc":
        coord.abort(r)
    coord.sync()


def test_it_stops_at_the_first_that_does_not_fit(coord) -> None:
    coord.reset()  # 16 pages of 4, nothing cached: nothing to evict
    coord.admit("big", list(range(1, 41)))  # 10 pages
    coord.admit("small", [7, 8, 9])  # 1 page
    assert coord.mirror.sizes().free == 5 * PAGE
    assert coord.extend_each(["small", "big"], 1) == 2  # big takes a page: 4 free
    assert _rows(coord, ["small", "big"]) == {"small": 4, "big": 41}
    assert coord.extend_each(["small", "big"], 20) == 0  # small would need 5 pages
    assert _rows(coord, ["small", "big"]) == {"small": 4, "big": 41}
    assert coord.extend_each(["big", "small"], 12) == 1  # big takes 3; small needs 3 of 1
    assert _rows(coord, ["small", "big"]) == {"small": 4, "big": 53}
    coord.sync()
    assert [i["digest"] for i in coord.ranks.call("info")] == [coord.mirror.digest()] * 2
    coord.abort("big")
    coord.abort("small")
    coord.sync()


def test_a_bad_id_raises_with_those_before_extended(coord) -> None:
    coord.reset()
    coord.admit("a", [1, 2, 3])
    with pytest.raises(UnknownRequest):
        coord.extend_each(["a", "nobody"], 1)
    assert _rows(coord, ["a"]) == {"a": 4}
    with pytest.raises(CacheError):
        coord.extend_each([["not", "an", "id"]], 1)
    with pytest.raises(CacheError):
        coord.extend_each(["a"], -1)
    assert _rows(coord, ["a"]) == {"a": 4}
    coord.sync()
    assert [i["digest"] for i in coord.ranks.call("info")] == [coord.mirror.digest()] * 2
    coord.abort("a")
    coord.sync()
