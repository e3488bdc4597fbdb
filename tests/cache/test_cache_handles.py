"""Handles cannot be forged: in the radix, host-tier and hybrid (SWA) caches, a handle
the cache did not give out for the node it names is refused by ``lock`` and ``unlock``
with ``UnknownHandle`` and changes nothing, whatever it copies from a real handle (the
owner every handle shows, another handle's tag); a namespace anchor is never lockable;
a handle of another cache, or of an evicted node, is refused. The key behind the tags
reaches nothing that processes compare: the same ops give the same digests, events and
slot ids in a fresh process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
from ns_helpers import ns_view, run_in

from tpcache.cache.errors import LockError, UnknownHandle
from tpcache.cache.host.cache import HostCache, HostConfig
from tpcache.cache.namespace import CacheNamespace, is_anchor
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

PS = 4
WINDOW = 8
A = CacheNamespace(salt="tenant-a")
SHORT = [1, 2, 3, 4]  # one page: shorter than the window, so its SWA lock reaches the anchor
LONG = list(range(10, 22))  # three pages
TAIL = list(range(30, 38))  # two more pages below LONG
OTHER = list(range(50, 58))


def radix() -> RadixCache:
    return RadixCache(CacheConfig(64, PS, record_events=True))


def host() -> HostCache:
    return HostCache(HostConfig(64, PS, host_capacity_tokens=128, record_events=True))


def hybrid() -> HybridCache:
    return HybridCache(HybridConfig(64, 64, WINDOW, PS, record_events=True))


KINDS: dict[str, Callable[[], Any]] = {"radix": radix, "host": host, "hybrid": hybrid}
kinds = pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())


def filled(make: Callable[[], Any]) -> Any:
    """A cache with a namespace (its anchor and one node below it) and, in the default
    namespace, LONG with TAIL below it; nothing locked."""
    c = make()
    run_in(c, "a", SHORT, A)
    run_in(c, "b", LONG)
    run_in(c, "c", LONG + TAIL)
    c.check_integrity()
    return c


def state(c: Any) -> tuple[Any, ...]:
    """What a refused call must leave as it was."""
    c.check_integrity()
    return c.digest(), c.pool_sizes(), ns_view(c), sorted(c.handles.locks.items())


def renamed(h: Any, to: Any) -> Any:
    """``h`` with the node (and, with a window, the boundary mark) of handle ``to``: what
    a caller can read off its own handles, with ``h``'s owner and tag."""
    if hasattr(h, "swa_boundary"):
        return dataclasses.replace(h, node_id=to.node_id, swa_boundary=to.swa_boundary)
    return dataclasses.replace(h, node_id=to.node_id)


def anchor(c: Any) -> Any:
    (found,) = [n for n in c.tree.walk() if is_anchor(n)]
    return found


def refused(c: Any, handle: Any) -> None:
    """``handle`` is refused by ``lock`` and ``unlock`` as not this cache's, and the
    cache is as it was."""
    before = state(c)
    with pytest.raises(UnknownHandle):
        c.lock(handle)
    with pytest.raises(UnknownHandle):
        c.unlock(handle)
    assert state(c) == before


def evicts_everything(c: Any) -> None:
    """Nothing is locked: an eviction of the whole device pool frees all of it."""
    c.evict(64)
    c.check_integrity()
    full = c.pool_sizes()[0]
    assert (full.free, full.protected, full.held) == (full.capacity, 0, 0)


@kinds
def test_a_forged_handle_naming_the_anchor_is_refused(make: Callable[[], Any]) -> None:
    c = filled(make)
    h = c.match_prefix(SHORT, A).handle  # ends just below the anchor
    top = anchor(c)
    assert c.tree.nodes[h.node_id].parent is top
    extra = (h.swa_boundary,) if hasattr(h, "swa_boundary") else ()  # the anchor's mark
    refused(c, dataclasses.replace(h, node_id=top.id))  # the owner and all else copied
    refused(c, type(h)(top.id, h.owner, *extra))  # built by hand
    with pytest.raises(UnknownHandle, match=f"handle {top.id} names a namespace anchor"):
        c.lock(type(h)(top.id, h.owner, *extra))
    evicts_everything(c)
    if make is not host:  # (a host tier keeps the namespace's node, and so its anchor)
        assert not any(is_anchor(n) for n in c.tree.walk())


@kinds
def test_a_handle_renamed_to_another_node_is_refused(make: Callable[[], Any]) -> None:
    c = filled(make)
    h = c.match_prefix(LONG).handle
    deeper = c.match_prefix(LONG + TAIL).handle
    assert c.tree.nodes[deeper.node_id].parent.id == h.node_id
    refused(c, dataclasses.replace(h, node_id=deeper.node_id))  # only the id changed
    refused(c, renamed(h, deeper))
    refused(c, renamed(deeper, h))
    with pytest.raises(UnknownHandle, match="not given out by this cache for node"):
        c.lock(renamed(h, deeper))
    # The real handle still works, also after a match splits its node (the lower half
    # keeps the id the tag was made for).
    c.match_prefix(LONG[:PS])
    c.lock(h)
    assert c.tree.nodes[h.node_id].lock == 1
    c.check_integrity()
    c.unlock(h)
    evicts_everything(c)


@kinds
def test_a_handle_of_another_cache_is_refused_even_relabelled(make: Callable[[], Any]) -> None:
    a, b = filled(make), filled(make)
    ha, hb = a.match_prefix(LONG).handle, b.match_prefix(LONG).handle
    assert ha.node_id == hb.node_id and ha.owner != hb.owner
    refused(a, hb)
    refused(a, dataclasses.replace(hb, owner=ha.owner))  # b's tag under a's owner
    assert ha.tag != hb.tag  # each cache its own key
    a.lock(ha)
    a.unlock(ha)
    evicts_everything(a)


@kinds
def test_a_handle_after_its_node_was_evicted_is_refused(make: Callable[[], Any]) -> None:
    c = filled(make)
    h = c.match_prefix(LONG + TAIL).handle
    c.evict(64)
    before = state(c)
    # Gone from the tree, or (with a host tier) gone from the device: refused as before.
    gone = LockError if make is host else UnknownHandle
    with pytest.raises(gone):
        c.lock(h)
    assert state(c) == before
    run_in(c, "d", OTHER)
    fresh = c.match_prefix(OTHER).handle
    assert fresh.node_id != h.node_id  # ids are never reused
    refused(c, renamed(h, fresh))  # nor can it be pointed at a node cached since
    evicts_everything(c)


@kinds
def test_a_copy_of_a_cache_keeps_its_handles_and_refuses_forged_ones(
    make: Callable[[], Any],
) -> None:
    c = filled(make)
    h = c.match_prefix(LONG).handle
    deeper = c.match_prefix(LONG + TAIL).handle
    copy = deepcopy(c)  # the same generation: its handles stay good
    refused(copy, renamed(h, deeper))
    copy.lock(h)
    copy.unlock(h)
    assert copy.digest() == c.digest()
    evicts_everything(copy)


def _ops(make: Callable[[], Any]) -> list[Any]:
    """Requests in two namespaces, each followed by a match whose handle is locked over
    an eviction and unlocked: what each step returned and the digests after it."""
    c = make()
    out: list[Any] = []
    for i in range(6):
        space = A if i % 2 else None
        toks = [100 + i % 3] * PS + list(range(i, i + 9))
        out.append(c.admit(i, toks, namespace=space).slots.tolist())
        c.finish(i)
        h = c.match_prefix(toks, space).handle
        c.lock(h)
        out.append([c.evict(12).num_tokens, c.digest()])
        c.unlock(h)
        out.append([c.evict(8).num_tokens, c.digest(), len(c.take_events())])
    c.check_integrity()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_ops_give_the_same_state_in_a_fresh_process(kind: str) -> None:
    here = _ops(KINDS[kind])
    assert here == _ops(KINDS[kind])
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import test_cache_handles as t\n"
        "print(json.dumps(t._ops(t.KINDS[sys.argv[2]])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), kind],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "4321"},
    )
    assert json.loads(proc.stdout) == json.loads(json.dumps(here))
