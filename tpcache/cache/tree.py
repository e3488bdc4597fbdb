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

This module is internal: ``RadixCache`` is the public face and hands out opaque handles,
never nodes.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from tpcache.cache.allocator import CACHED, HELD, PageAllocator
from tpcache.cache.errors import IntegrityError, InvalidSlots, LockError
from tpcache.cache.events import BlockRemoved, BlockStored, KVEvent
from tpcache.cache.hashing import ROOT_STATE, PageHasher, block_hashes
from tpcache.cache.keys import key_bytes
from tpcache.cache.policies import KeyFn, PolicyHooks

_EMPTY_PAGES = np.zeros(0, dtype=np.int64)
_EMPTY_STATES = np.zeros(0, dtype=np.uint64)
_K = 0xA24BAED4963EE407  # odd
_MASK = (1 << 64) - 1


def page_terms(states: np.ndarray, pages: np.ndarray) -> int:
    """Digest terms of cached pages: the sum of ``state * (page + K)`` mod 2**64, so it
    covers each block (its chain state) with its page id; additive over pages. Two numpy
    calls."""
    p = pages.view(np.uint64) if pages.dtype == np.int64 else pages.astype(np.uint64)
    return (int(states @ p) + _K * int(np.add.reduce(states))) & _MASK


def descend(node, ps: int, key: np.ndarray, n: int, pos: int):
    """The walk behind ``RadixTree.descend`` and ``SwaTree.descend`` (same node layout:
    ``children`` keyed by first-page bytes, ``kb`` the node's token bytes): one dict
    probe and one byte comparison per node, a vectorised compare where it diverges."""
    path = []
    if pos >= n:
        return path, pos, None, 0
    mv = memoryview(key).cast("B")  # byte offsets below: 4 per token, no copy
    b, end, pb = 4 * pos, 4 * n, 4 * ps
    while b < end:
        child = node.children.get(mv[b : b + pb].tobytes())
        if child is None:
            break
        kb = child.kb
        m = len(kb)
        if b + m <= end:
            if kb.startswith(mv[b : b + m]):  # equal: same length
                path.append(child)
                b += m
                node = child
                continue
        elif kb.startswith(mv[b:end]):
            return path, b // 4, child, (end - b) // 4
        pos = b // 4
        ck = np.frombuffer(kb, dtype=np.int32)
        m = min(ck.size, n - pos)
        common = int((key[pos : pos + m] == ck[:m]).argmin()) // ps * ps
        return path, pos, child, common
    return path, b // 4, None, 0


def defer_hash(tree, node, now: bool) -> None:
    """Hash ``node`` now, or remember it for ``hash_pending`` (any tree with ``root``,
    ``hasher``, ``nodes``, ``digest_sum`` and ``_unhashed``)."""
    if now:
        hash_node(tree, node)
        return
    tree._unhashed.append(node)
    if len(tree._unhashed) > 2 * len(tree.nodes) + 1024:
        # Drop evicted nodes, so a cache nobody asks for a digest keeps no dead node
        # alive (amortised O(1) per insert).
        tree._unhashed = [n for n in tree._unhashed if n.alive and n.states is None]


def hash_pending(tree) -> None:
    """Hash every node still waiting (parents first); see ``RadixTree.ensure_hashed``."""
    pending, tree._unhashed = tree._unhashed, []
    for node in pending:
        if node.alive and node.states is None:
            hash_node(tree, node)


def hash_node(tree, node) -> None:
    """Chain states and digest term of ``node`` and of its unhashed ancestors."""
    chain = []
    while node is not tree.root and node.states is None:
        chain.append(node)
        node = node.parent
    for n in reversed(chain):
        parent = n.parent
        parent_state = int(parent.states[-1]) if parent.states.size else ROOT_STATE
        n.states = tree.hasher.chain(np.frombuffer(n.kb, dtype=np.int32), parent_state)
        n.term = page_terms(n.states, n.pages)
        tree.digest_sum = (tree.digest_sum + n.term) & _MASK


class Node:
    """One run of cached pages. Owned and mutated only by its ``RadixTree``."""

    __slots__ = (
        "alive",
        "children",
        "created",
        "hits",
        "id",
        "kb",
        "last_access",
        "lock",
        "pages",
        "parent",
        "priority",
        "queued",
        "states",
        "term",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        key: bytes | np.ndarray,
        pages: np.ndarray,
        states: np.ndarray | None,  # None until hashed (RadixTree.ensure_hashed)
        tick: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.kb = key if isinstance(key, bytes) else key.tobytes()  # int32 tokens, as bytes
        self.pages = pages
        self.states = states
        self.term = 0  # this node's share of the tree's digest_sum (page_terms)
        self.lock = 0  # requests whose locked path runs through this node
        self.last_access = tick
        self.created = tick
        self.hits = 0
        self.priority = 0
        self.queued: tuple[int, ...] | None = None  # key of this node's live heap entry
        self.alive = True

    @property
    def key(self) -> np.ndarray:
        """The node's tokens: a read-only int32 view of ``kb`` (no copy)."""
        return np.frombuffer(self.kb, dtype=np.int32)

    @key.setter
    def key(self, tokens: np.ndarray) -> None:
        self.kb = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()


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
        self, path: list[Node], pos: int, partial: Node | None, common: int
    ) -> tuple[list[Node], int]:
        """Make a ``descend`` result the match: split the partial node, touch the path."""
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
        if path:
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
            known = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
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
        return have, np.concatenate(parts), end

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
            pages = np.concatenate(freed_pages) if len(freed_pages) > 1 else freed_pages[0]
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
        self.ensure_hashed()
        ps = self.ps
        nodes = self.walk()
        if len(nodes) + 1 != len(self.nodes):
            raise IntegrityError(
                f"tree walk finds {len(nodes)} nodes, index has {len(self.nodes) - 1}"
            )
        pages_total = protected = 0
        all_pages = []
        digest = 0
        live = {(n.queued, n.id) for _, n in self._heap if n.queued is not None}
        for node in nodes:
            parent = node.parent
            if parent is None or not node.alive or self.nodes.get(node.id) is not node:
                raise IntegrityError(f"node {node.id} is detached or not indexed")
            if parent.children.get(node.kb[: 4 * ps]) is not node:
                raise IntegrityError(
                    f"node {node.id} is not under its first-page key in its parent"
                )
            if not node.kb or len(node.kb) != 4 * node.pages.size * ps:
                raise IntegrityError(
                    f"node {node.id}: {len(node.kb) // 4} tokens for {node.pages.size} pages"
                    f" of {ps}"
                )
            if node.pages.dtype != np.int64:
                raise IntegrityError(f"node {node.id}: pages of dtype {node.pages.dtype}")
            if node.states.size != node.pages.size:
                raise IntegrityError(
                    f"node {node.id}: {node.states.size} hash states, {node.pages.size} pages"
                )
            if node.lock < 0:
                raise IntegrityError(f"node {node.id} has lock {node.lock}")
            child_locks = sum(c.lock for c in node.children.values())
            if node.lock < child_locks:
                raise IntegrityError(
                    f"node {node.id} lock {node.lock} < its children's {child_locks}"
                )
            parent_state = int(parent.states[-1]) if parent.states.size else ROOT_STATE
            if not np.array_equal(self.hasher.chain(node.key, parent_state), node.states):
                raise IntegrityError(f"node {node.id}: block hash chain does not match its tokens")
            if (
                node.lock == 0
                and not node.children
                and (node.queued != self.key_fn(node) or (node.queued, node.id) not in live)
            ):
                raise IntegrityError(f"unlocked leaf {node.id} is not in the eviction queue")
            pages_total += node.pages.size
            protected += node.pages.size if node.lock else 0
            all_pages.append(node.pages)
            term = page_terms(node.states, node.pages)
            if term != node.term:
                raise IntegrityError(f"node {node.id}: digest term {node.term:#x} != {term:#x}")
            digest += term
        if pages_total != self.cached_pages or protected != self.protected_pages:
            raise IntegrityError(
                f"tree holds {pages_total} pages ({protected} protected), counters say "
                f"{self.cached_pages} ({self.protected_pages} protected)"
            )
        if self.alloc.count(CACHED) != pages_total:
            raise IntegrityError(
                f"allocator has {self.alloc.count(CACHED)} cached pages, tree {pages_total}"
            )
        if all_pages:
            flat = np.concatenate(all_pages)
            if np.unique(flat).size != flat.size:
                raise IntegrityError("a page is referenced by two tree nodes")
            if (self.alloc.tags_of(flat) != CACHED).any():
                raise IntegrityError("a tree page is not tagged cached in the allocator")
        if digest & _MASK != self.digest_sum:
            raise IntegrityError(
                f"tree digest {self.digest_sum:#x} != recomputed {digest & _MASK:#x}"
            )
        if self.hooks is not None:
            self.hooks.check_integrity()
