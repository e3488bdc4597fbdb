"""``HostCache``: the one-pool cache with a host (CPU) tier behind its device pool.

It is ``PrefixCache`` (``prefix.py``) over a device ``PageAllocator``, a host one and
the tiered tree (``host/tree.py``), so a cache without the tier is ``RadixCache``
untouched and pays nothing for it. What changes with the tier:

- A match is the device prefix and, beyond it, the host prefix: ``match_prefix``
  reports it as ``host_hit_length``; ``admit`` loads it, in the same allocation as the
  request's own pages (so one eviction makes room for both, and a refusal comes before
  anything changes), and counts it in ``prefix_len``.
- An eviction moves device pages to the host (write-back) or drops them
  (write-through-selective, where hot nodes were copied already).
- An insert that walks over host-only nodes (a request computed tokens the host holds)
  gives them the request's device pages first, top-down, so the device tier stays
  closed under parents; the rest is the base insert.

Copies and their completion. Every move between the tiers starts a copy in the copy
log (``cache.host.take_copies`` hands them to whoever runs them, in id order; the
calls on copies are the cache's host part, ``host/tier.py``); the cache's own
decisions never wait for one, so its state, hit rates and slot ids are the same however
fast copies run. What waits is the KV data's reader: a request's forward. A page can be
touched by a copy that is not done in two ways: a write-back still reads the device
pages an eviction just freed (and an admit or extend may hand them out at once), and a
load still writes the device pages of the prefix it brings back. Copies run one at a
time in id order (``kv/host_copy.py``), so copy-after-copy hazards (a host page
freed and written again, a load of a node still being written) are ordered by the ids
alone; copy-versus-forward hazards are closed by readiness, per request and only for
the copies that touch its own row's device pages (``host/waits.py``), recorded by an
admit, extend or ``cache_unfinished``. A load into them (the forward reads them) must be
done on every rank: ``ready_after``, agreed through ``copies_done`` (``request_ready``;
the ranks refuse the forward before, the coordinator and a frontend wait for it). A
write-back still reading a page the row was given is a hazard on each rank's own shard
only: each rank's forward first waits for its own copy engine (``local_after``,
``workers/copysync.py``), so no reply waits for an agreement for it. Why a page freed
while its write-back is in flight is never overwritten first: a forward writes only its
request's row (the ranks check its slots against their cache), a page enters a row only
through an admit, extend or ``cache_unfinished``, each of which records the copies that
still read it, and a rank runs a forward only once its engine has done them; pages lent
by ``alloc_slots`` have no op in a lockstep, and a single process completes every copy as
it starts. This never makes an admit fail or wait for a copy. Without ``defer_copies``
nothing ever waits (a replay).

Namespaces (LoRA adapters, cache salts) are the base tree's anchors: a match, an insert
and a load walk from the request's anchor, and an anchor goes when its last child does,
from either tier (``host/moves.py``).

The hybrid (SWA) cache has no host tier: ``HostConfig`` is a one-pool configuration.
The contracts of every method: ``protocol.Cache``, and ``parts.HostPart`` for its part.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.allocator import HELD, LENT, PageAllocator
from tpcache.cache.errors import HostTierError, OutOfCapacity
from tpcache.cache.host.config import HostAdmitResult, HostConfig, HostMatchResult
from tpcache.cache.host.inserts import check_lent, revive
from tpcache.cache.host.moves import load
from tpcache.cache.host.pool import HostPool
from tpcache.cache.host.tier import HostTier
from tpcache.cache.host.tree import HostTree
from tpcache.cache.keys import (
    TokenLike,
    as_tokens,
    check_sign,
    join_pages,
)
from tpcache.cache.policy.policies import policy_key
from tpcache.cache.protocol import Evictor
from tpcache.cache.radix import OnePoolCache
from tpcache.cache.records import RequestId
from tpcache.cache.reqtable import Beyond, Locked, Taken
from tpcache.cache.tree.anchors import insert_start, match_in
from tpcache.cache.tree.check import check_cache
from tpcache.cache.tree.insert import insert_key
from tpcache.cache.tree.node import Match, pages_of

__all__ = ["HostCache", "HostConfig"]


class HostCache(OnePoolCache):
    """A paged radix prefix cache over a device pool with a host pool behind it.

    Owned as in ``PrefixCache``; the tree owns the host allocator and the copy log,
    ``host`` (its ``HostTier``, made here) the waits on it. No sliding window."""

    tree: HostTree
    host: HostTier

    def __init__(self, config: HostConfig) -> None:
        if not isinstance(config, HostConfig):
            raise HostTierError(
                f"a host tier needs a HostConfig (one pool), got {type(config).__name__}"
            )
        alloc = PageAllocator(config.num_pages, config.page_size)
        tree = HostTree(
            alloc,
            policy_key(config.policy),
            HostPool(config.num_host_pages, config.page_size),
            config.through_hits,
            record_events=config.record_events,
            record_copies=config.record_copies,
            defer_copies=config.defer_copies,
            medium=config.medium,
        )
        super().__init__(config, alloc, tree)
        self.host = HostTier(self)  # its part: the copy log's completion and the waits on it

    # ---- matches --------------------------------------------------------------------------
    def admit_prefix_len(self, tokens: TokenLike, namespace: Any = None) -> int:
        key = as_tokens(tokens)
        n = (key.size - 1) // self.page_size * self.page_size
        return match_in(self.tree, key, n, namespace)[1].end  # the host part too: an admit loads it

    def match_prefix(self, tokens: TokenLike, namespace: Any = None) -> HostMatchResult:
        key = as_tokens(tokens, defer_sign=True)
        tree = self.tree
        _, found = match_in(tree, key, key.size // self.page_size * self.page_size, namespace)
        check_sign(key, found.end)
        path, pos, partial, common, *_ = tree.tier_cut(*found)
        host = found.end - pos - common
        path, pos = tree.split_match(path, pos, partial, common)
        tree.touch(path)
        res = self._match_result(path, pos)
        wait = tree.copies.pending_on(res.pages, True)
        return HostMatchResult(res.prefix_len, res.pages, res.handle, self.page_size, host, wait)

    # ---- the admit's steps: the host part of a match is loaded with the request's pages --
    def _cut(self, found: Match) -> tuple[Match, Beyond]:
        path, pos, partial, common = found
        if (path and not path[-1].dev) or (partial is not None and not partial.dev):
            cut = self.tree.tier_cut(path, pos, partial, common)
            return Match(*cut[:4]), (cut.hosts, cut.host_partial, cut.host_common)
        return found, ([], None, 0)  # all on the device (``tier_cut``'s last case): most admits

    def _take_row(self, locked: Locked, need: int, evict: bool | Evictor, beyond: Beyond) -> Taken:
        path, pos, node, _ = locked
        tree = self.tree
        hosts, hpart, hcommon = beyond
        if hpart is not None:
            hosts.append(tree.split(hpart, hcommon))
        for h in hosts:  # no host eviction may take what this admit loads
            h.pinned = True
        try:
            pages = self._room.take(need, evict)
        except OutOfCapacity:
            tree.unlock(node)
            self._unpin(hosts)
            raise
        loaded = load(tree, hosts, pages) * self.page_size if hosts else 0
        if hosts:  # the request's lock moves to the end of what was loaded
            node = self._extend_lock(hosts, node)
            path = path + hosts
        row = join_pages([*map(pages_of, path), pages[loaded // self.page_size :]])
        tree.touch(path, queue=False)  # after the load: a write-through touch starts copies
        return Taken(row, node, pos + loaded, loaded)

    def _admit_result(self, rid: RequestId, taken: Taken, total: int) -> HostAdmitResult:
        c = self.tree.copies  # (a new request waits for nothing unless copies are pending)
        wait = self.host.waits.record(rid, taken.row) if c.started != c.completed else 0
        ps = self.page_size
        return HostAdmitResult(taken.pos, taken.row, total, ps, taken.loaded, wait)

    def _extend_lock(self, hosts: list[Any], locked: Any) -> Any:
        """``lock(hosts[-1])`` then ``unlock(locked)``, the node the admit locked, without
        the two walks to the root: their locks and protected pages end the same. Only the
        nodes from ``hosts[-1]`` up to ``locked`` change: ``hosts``, and what lies between
        ``hosts[0]`` and ``locked`` (a namespace's anchor, when nothing matched on the
        device and the admit locked the root). Returns the new end of the lock."""
        tree = self.tree
        for h in hosts:
            if h.lock == 0:
                tree.protected_pages += h.pages.size
            h.lock += 1
        above = hosts[0].parent
        while above is not locked and above is not tree.root:
            if above.lock == 0:
                tree.protected_pages += above.pages.size
            above.lock += 1
            above = above.parent
        return hosts[-1]

    def _unpin(self, hosts: list[Any]) -> None:
        for h in hosts:
            h.pinned = False
            if not h.children:
                self.tree.host_leaves.push(h)

    # ---- inserts (over host-only nodes: ``host/inserts.py``) -----------------------------
    def insert(
        self, tokens: TokenLike, slots: TokenLike, priority: int = 0, namespace: Any = None
    ) -> int:
        key, pages, prio, start = self._insert_args(tokens, slots, priority, namespace)
        tree = self.tree
        if tree.host_only_pages():
            check_lent(tree, key, pages, start)
            revive(tree, key, pages, start or tree.root, 0, LENT)
        return insert_key(tree, key, pages, prio, owner=LENT, start=start)[0]

    # ---- the lifecycle's hooks: host-only nodes on the way, and copy waits ---------------
    def _walk_start(self, req: Any, key: np.ndarray, pages: np.ndarray, start_pos: int) -> Any:
        tree = self.tree
        node = req.node
        if req.space is not None:  # its anchor, made if the walk goes below the root
            node = insert_start(tree, node, req.space, key.size > start_pos)
        # ``revive``'s own first checks, inline (most walks meet nothing host-only): any
        # host-only node at all, and a child where the walk starts.
        if (
            tree.host_pages != tree.copy_pages
            and key[start_pos : start_pos + self.page_size].tobytes() in node.children
        ):
            revive(tree, key, pages, node, start_pos, HELD)
        return node

    def _row_changed(self, req: Any) -> None:
        c = self.tree.copies  # its new pages may be ones a write-back still reads
        if c.started != c.completed:
            self.host.waits.record(req.rid, req.pages)

    def _release(self, req: Any) -> None:
        super()._release(req)
        if self.host.waits.local:  # (``waits`` is empty when ``local`` is: loads are copies)
            self.host.waits.forget(req.rid)

    def reset(self) -> None:
        super().reset()
        self.host.waits.waits.clear()
        self.host.waits.local.clear()

    def check_integrity(self) -> None:
        check_cache(self)
        self.host.check()
