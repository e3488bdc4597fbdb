"""The paged radix tree: cached prefixes, their pages, locks and the eviction queue.

Each node holds a run of whole pages: its tokens (the bytes of int32 ids), its page ids
(int64, one per page) and the chain state of each page's block hash (uint64). Children
are keyed by the bytes of their first page, so a lookup costs one dict probe per node
and a comparison is one ``memcmp`` per node (``bytes.startswith`` on a memoryview of
the query), never a Python step per token and no numpy call per node.

Eviction candidates (unlocked leaves) sit in a heap ordered by the policy key. Entries
are not removed when a node changes; a popped entry is used only if it is still the
node's current entry and the node is still an unlocked leaf. The heap is rebuilt only
when stale entries outnumber live nodes, so each change costs O(log n) amortised.

The node and the lookup walk are in ``node.py`` (shared with the hybrid tree), the full
walk of ``check_integrity`` in ``tree_check.py``. This module is internal:
``RadixCache`` is the public face and hands out opaque handles, never nodes.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from tpcache.cache.allocator import CACHED, HELD, PageAllocator
from tpcache.cache.errors import InvalidSlots, LockError
from tpcache.cache.events import BlockRemoved, BlockStored, KVEvent
from tpcache.cache.hashing import PageHasher, block_hashes
from tpcache.cache.keys import join_pages, key_bytes
from tpcache.cache.node import (
    _EMPTY_PAGES,
    _EMPTY_STATES,
    _MASK,
    Node,
    defer_hash,
    descend,
    hash_pending,
    page_terms,
)
from tpcache.cache.policies import KeyFn, PolicyHooks
from tpcache.cache.tree_check import check_tree

__all__ = ["Node", "RadixTree"]


class RadixTree:
    """Radix tree over whole pages, with locks, a policy-ordered eviction heap and events.

    The tree owns its nodes; the allocator owns page tags. Pages enter the tree from
    HELD (a request's) and leave it to FREE (eviction). ``tick`` is the logical clock.
    """

    def __init__(
        self,
        alloc: PageAllocator,
        key_fn: KeyFn,
        *,
        record_events: bool = False,
        medium: str = "GPU",
        hooks: PolicyHooks | None = None,
    ) -> None:
        self.alloc = alloc
        self.ps = alloc.page_size
        self.key_fn = key_fn
        # A stateful policy's state, told of every match, new leaf, eviction and clear.
        self.hooks = hooks
        if hooks is not None:
            hooks.attach(self)
        self.hasher = PageHasher(self.ps)
        self.record_events = record_events
        self.medium = medium
        self.events: list[KVEvent] = []
        # Statistics only (wall time never decides anything): per-evict-call seconds, kept
        # for the last 10,000 calls, and pages evicted since creation.
        self.evict_seconds: list[float] = []
        self.evicted_pages = 0
        # Node ids only grow, across reset() too, so a handle from before a reset can
        # never name a node created after it.
        self._next_id = 1
        self._clear()

    def _clear(self) -> None:
        self.root = Node(0, None, b"", _EMPTY_PAGES, _EMPTY_STATES, 0)
        self.root.lock = 1  # the root is never evicted
        self.nodes: dict[int, Node] = {0: self.root}
        self.tick = 0
        self.cached_pages = 0
        self.protected_pages = 0
        self.digest_sum = 0
        # Nodes whose block hashes are not computed yet (see ``ensure_hashed``).
        self._unhashed: list[Node] = []
        self._heap: list[tuple[tuple[int, ...], Node]] = []
        if self.hooks is not None:
            self.hooks.reset()

    # ---- lookup -------------------------------------------------------------------------
    def descend(
        self, key: np.ndarray, n: int, node: Node | None = None, pos: int = 0
    ) -> tuple[list[Node], int, Node | None, int]:
        """Walk ``key[:n]`` (page-aligned) without changing anything.

        Starts at the root, or at ``node`` that is known to end at ``key[:pos]``.
        Returns the fully matched nodes after the start, the tokens matched up to the
        last of them, and the node where the match stops part-way with its matched
        token count (``None, 0`` if none). ``key`` is a C-contiguous int32 array.
        """
        return descend(self.root if node is None else node, self.ps, key, n, pos)

    def split(self, child: Node, at: int) -> Node:
        """Cut ``child`` after ``at`` tokens (whole pages); returns the new upper node.

        Both halves get copies, so a short node never pins a long freed array. The
        lower half keeps the id, so a handle to it still ends at the same point.
        """
        ps = self.ps
        cut = at // ps
        parent = child.parent
        assert parent is not None and 0 < at < len(child.kb) // 4 and at % ps == 0
        hashed = child.states is not None
        upper = Node(
            self._new_id(),
            parent,
            child.kb[: 4 * at],
            child.pages[:cut].copy(),
            child.states[:cut].copy() if hashed else None,
            child.created,
        )
        upper.last_access = child.last_access
        upper.hits = child.hits
        upper.priority = child.priority
        upper.lock = child.lock
        if hashed:
            upper.term = page_terms(upper.states, upper.pages)
            child.term = (child.term - upper.term) & _MASK
            child.states = child.states[cut:].copy()
        else:
            self._unhashed.append(upper)
        child.kb = child.kb[4 * at :]
        child.pages = child.pages[cut:].copy()
        pb = 4 * ps
        parent.children[upper.kb[:pb]] = upper
        upper.children[child.kb[:pb]] = child
        child.parent = upper
        self.nodes[upper.id] = upper
        return upper

    def take_match(
        self,
        path: list[Node],
        pos: int,
        partial: Node | None,
        common: int,
        *,
        queue: bool = True,
    ) -> tuple[list[Node], int]:
        """Make a ``descend`` result the match: split the partial node, touch the path.

        ``queue=False``: the caller locks the match's end at once (``admit``), so its
        new eviction key would only be a stale heap entry; unlock queues it again.
        """
        if partial is not None:
            path.append(self.split(partial, common))
            pos += common
        self.tick += 1
        tick = self.tick
        if self.hooks is not None:
            self.hooks.on_match(path, tick)
        for node in path:
            node.last_access = tick
            node.hits += 1
        if path and queue:
            self._queue(path[-1])
        return path, pos

    # ---- insert -------------------------------------------------------------------------
    def insert(
        self,
        key: np.ndarray,
        pages: np.ndarray,
        priority: int = 0,
        *,
        start: Node | None = None,
        start_pos: int = 0,
        trusted: bool = False,
        owner: int = HELD,
        want_pages: bool = True,
    ) -> tuple[int, np.ndarray | None, Node]:
        """Cache ``key`` (whole pages) backed by ``pages`` (tagged ``owner``: HELD for a
        request's row, LENT for a caller's slots).

        Pages of the already-cached part that differ from the tree's are duplicates and
        are freed; the rest become the tree's. Returns (tokens already cached, the
        tree's pages for the whole key or ``None`` unless ``want_pages``, the node
        ending at ``key``).

        ``start``/``start_pos``: a node known to end at ``key[:start_pos]`` whose pages
        are ``pages[:start_pos // ps]`` (a request's locked prefix), so the walk begins
        there. Unless ``trusted`` (the caller's own request rows), every page is
        validated first and ``InvalidSlots`` is raised before anything changes.
        """
        ps = self.ps
        n = key.size
        path, pos, partial, common = self.descend(key, n, start, start_pos)
        have = pos + common
        k0 = start_pos // ps
        k = have // ps
        if k > k0:  # the tree's pages where the walk went, and the given ones that differ
            pieces = [p.pages for p in path]
            if partial is not None:
                pieces.append(partial.pages[: common // ps])
            known = join_pages(pieces) if len(pieces) > 1 else pieces[0]
            given = pages[k0:k]
            dups = given[given != known]
        else:
            known = dups = _EMPTY_PAGES
        fresh = pages[k:]
        if not trusted:
            mine = np.concatenate((dups, fresh)) if dups.size else fresh
            try:
                self.alloc.check_owned(mine, owner)
            except Exception as exc:
                raise InvalidSlots(f"cannot insert: {exc}") from None

        if partial is not None:
            path.append(self.split(partial, common))
        end = path[-1] if path else (start or self.root)
        self.tick += 1
        tick = self.tick
        node = end
        while node is not self.root:
            # Touch the whole path: a request's locked prefix is being used too.
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
            node = node.parent  # type: ignore[assignment]
        if dups.size:
            self.alloc.free(dups, owner, checked=False)
        if have < n:
            end = self._add_child(end, key[have:], fresh.copy(), priority, owner)
        else:
            self._queue(end)
        if not want_pages:
            return have, None, end
        parts = [pages[:k0], known] if k0 else [known]
        if have < n:
            parts.append(fresh)  # the new leaf's pages (a policy may have split it)
        return have, join_pages(parts), end

    def _add_child(
        self, parent: Node, key: np.ndarray, pages: np.ndarray, priority: int, owner: int
    ) -> Node:
        """A new leaf under ``parent``: ``key`` (int32, copied into the node), ``pages``
        (the node's own array from now on), tagged ``owner`` until now."""
        node = Node(self._new_id(), parent, key_bytes(key), pages, None, self.tick)
        node.priority = priority
        parent.children[node.kb[: 4 * self.ps]] = node
        self.nodes[node.id] = node
        self.alloc.retag(pages, owner, CACHED, checked=False)
        self.cached_pages += pages.size
        # Events and stateful policies need the block hashes now; else they wait.
        defer_hash(self, node, now=self.record_events or self.hooks is not None)
        states = node.states
        if self.record_events:
            parent_hash = int(block_hashes(parent.states[-1:])[0]) if parent.states.size else None
            self.events.append(
                BlockStored(
                    block_hashes=block_hashes(states).tolist(),
                    parent_block_hash=parent_hash,
                    token_ids=key.tolist(),
                    block_size=self.ps,
                    medium=self.medium,
                )
            )
        if self.hooks is not None:
            node = self.hooks.on_insert(node)  # may split off an upper node
        self._queue(node)
        return node

    def ensure_hashed(self) -> None:
        """Compute the block hashes (and digest terms) of every node that lacks them.

        Hashing is deferred until a digest, the events or a check needs it: a cache whose
        digest nobody asks for (a single-process replay) never pays for it. Each node is
        hashed once, parents first, so the total cost is the same as hashing at insert.
        """
        hash_pending(self)

    # ---- locks --------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (counts nest)."""
        root = self.root
        while node is not root:
            if node.lock == 0:
                self.protected_pages += node.pages.size
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        """Undo one ``lock``; raises ``LockError`` (changing nothing) if not locked."""
        if node is self.root:
            return
        if node.lock <= 0:
            raise LockError(f"node {node.id} is not locked")
        root = self.root
        while node is not root:
            node.lock -= 1
            if node.lock == 0:
                self.protected_pages -= node.pages.size
                if not node.children:
                    self._queue(node)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction -----------------------------------------------------------------------
    def _queue(self, node: Node) -> None:
        if node.lock or node.children or not node.alive:
            return
        k = self.key_fn(node)
        if node.queued == k:
            return
        node.queued = k
        heapq.heappush(self._heap, (k, node))
        if len(self._heap) > 2 * len(self.nodes) + 1024:
            self._rebuild_heap()

    def rekey(self) -> None:
        """Recompute every candidate's key: a stateful policy's key function changed."""
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = []
        for node in self.nodes.values():
            node.queued = None
            if node.lock == 0 and not node.children:
                node.queued = self.key_fn(node)
                heap.append((node.queued, node))
        heapq.heapify(heap)
        self._heap = heap

    def evict(self, num_pages: int) -> tuple[int, int]:
        """Evict unlocked leaves in policy order until ``num_pages`` are freed or none is left.

        A parent that becomes an unlocked leaf joins the queue at once. Frees all the
        pages in one free group. Returns (pages freed, nodes evicted).
        """
        started = time.perf_counter()
        freed_pages: list[np.ndarray] = []
        terms = 0
        count = 0
        pb = 4 * self.ps
        gone: list[Node] | None = [] if self.hooks is not None else None
        # Read self._heap each round: queueing a parent may rebuild it into a new list.
        while count < num_pages and self._heap:
            k, node = heapq.heappop(self._heap)
            if node.queued != k:
                continue
            node.queued = None
            if node.lock or node.children or not node.alive:
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.kb[:pb]]
            del self.nodes[node.id]
            node.alive = False
            count += node.pages.size
            freed_pages.append(node.pages)
            terms += node.term
            if gone is not None:
                gone.append(node)
            if self.record_events:
                self.events.append(
                    BlockRemoved(
                        block_hashes=block_hashes(node.states).tolist(), medium=self.medium
                    )
                )
            if not parent.children and parent is not self.root:
                self._queue(parent)
        if freed_pages:
            pages = join_pages(freed_pages) if len(freed_pages) > 1 else freed_pages[0]
            self.cached_pages -= pages.size
            self.digest_sum = (self.digest_sum - terms) & _MASK
            self.alloc.free(pages, CACHED, checked=False)
        if gone:
            self.hooks.on_evict(gone)  # type: ignore[union-attr]
        self.evicted_pages += count
        self.evict_seconds.append(time.perf_counter() - started)
        if len(self.evict_seconds) > 20_000:
            del self.evict_seconds[:10_000]
        return count, len(freed_pages)

    def _new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    # ---- whole-tree views -----------------------------------------------------------------
    def walk(self) -> list[Node]:
        """Every node but the root, parents before children, children in key order."""
        out: list[Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out

    def check_integrity(self) -> None:
        """Walk the whole tree and recount; raise ``IntegrityError`` naming what broke."""
        check_tree(self)
