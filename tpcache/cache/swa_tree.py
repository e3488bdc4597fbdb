"""The hybrid radix tree: full KV for every cached token, SWA KV only where it is visible.

Nodes hold runs of whole pages as in ``tree.py`` (int32 tokens kept as bytes, compared
with one ``memcmp`` per node; one int64 full page id and one hash chain state per
page); their SWA pages are found through the paired allocator's full -> SWA mapping.
A node whose SWA KV was dropped is a *tombstone*: its full KV stays, so a match may run
through it, but a match may end only where the last ``window`` tokens before the end
point have SWA KV (or where the path has no tombstone at all). The count of tokens
since the last tombstone restarts at every tombstone.

Invariant kept after every operation: every leaf is a valid match end (so no tombstone
is a leaf, and a branch's last window stays matchable). A leaf that would break it is
deleted, cascading upward; see ``SwaEvictor``.

Locks are two-level (``swa_locks.py``): full KV from a node to the root, SWA KV of the
last ``window`` tokens of its path.

This module is internal: ``HybridCache`` is the public face and hands out handles,
never nodes. Nodes are in ``swa_node.py``, eviction in ``swa_evict.py``, locks in
``swa_locks.py``, the full walk of ``check_integrity`` in ``swa_check.py``.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import CACHED, HELD
from tpcache.cache.errors import InvalidSlots
from tpcache.cache.events import BlockStored, KVEvent
from tpcache.cache.hashing import PageHasher, block_hashes
from tpcache.cache.keys import join_pages, key_bytes
from tpcache.cache.node import defer_hash, descend, page_terms
from tpcache.cache.policies import KeyFn
from tpcache.cache.swa_allocator import PairedAllocator
from tpcache.cache.swa_evict import SwaEvictor
from tpcache.cache.swa_locks import SwaLocks
from tpcache.cache.swa_node import ROOT_MARK, SwaNode

_EMPTY_PAGES = np.zeros(0, dtype=np.int64)
_EMPTY_STATES = np.zeros(0, dtype=np.uint64)
_MASK = (1 << 64) - 1


class SwaTree(SwaEvictor, SwaLocks):
    """Radix tree over whole pages with tombstones, two-level locks and two eviction orders.

    The tree owns its nodes and counters; the paired allocator owns page tags and the
    SWA mapping. Pages enter from HELD (a request's) and leave to FREE (eviction), or
    lose only their SWA part (tombstoning). ``tick`` is the logical clock.
    """

    def __init__(
        self,
        alloc: PairedAllocator,
        key_fn: KeyFn,
        window: int,
        *,
        swa_key_fn: KeyFn | None = None,
        record_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        self.alloc = alloc
        self.ps = alloc.page_size
        self.window = window
        self.key_fn = key_fn  # the full order's key
        # The SWA order's key (``swa_evict.swa_policy_key``): it reads the SWA recency, so
        # a touch requeues only a path's last window. Without one the full key serves,
        # and a touch requeues the whole path.
        self.swa_key_fn = swa_key_fn or key_fn
        self._swa_keyed_by_path = swa_key_fn is None
        self.hasher = PageHasher(self.ps)
        self.record_events = record_events
        self.medium = medium
        self.events: list[KVEvent] = []
        # Statistics only (wall time never decides anything).
        self.evict_seconds: list[float] = []
        self.evicted_pages = 0  # full pages freed by eviction since creation
        self.evicted_swa_pages = 0  # SWA pages freed by eviction (tombstoning included)
        self.tombstoned_nodes = 0  # nodes that became tombstones since creation
        # Ids and marks only grow, across reset too: an old handle never names a new node.
        self._next_id = 1
        self._next_mark = ROOT_MARK + 1
        self._clear()

    def _clear(self) -> None:
        self.root = SwaNode(0, None, b"", _EMPTY_PAGES, _EMPTY_STATES, 0)
        self.root.lock = self.root.swa_lock = 1  # the root is never evicted
        self.root.mark = ROOT_MARK
        self.nodes: dict[int, SwaNode] = {0: self.root}
        self.tick = 0
        self.cached_pages = 0  # full pages in the tree
        self.protected_pages = 0  # full pages of nodes with lock > 0
        self.swa_pages = 0  # SWA pages in the tree (pages of non-tombstones)
        self.swa_protected = 0  # SWA pages of nodes with swa_lock > 0
        self.tombstones = 0  # tombstone nodes
        self.tombstone_pages = 0  # their full pages
        self.digest_sum = 0
        self._unhashed: list[SwaNode] = []  # nodes whose block hashes wait (hash_pending)
        self._heap: list[tuple[tuple[int, ...], SwaNode]] = []
        self._swa_heap: list[tuple[tuple[int, ...], SwaNode]] = []

    # ---- lookup -------------------------------------------------------------------------
    def descend(
        self, key: np.ndarray, n: int, node: SwaNode | None = None, pos: int = 0
    ) -> tuple[list[SwaNode], int, SwaNode | None, int]:
        """Walk ``key[:n]`` (page-aligned) through tombstones too, changing nothing.

        Same contract as ``RadixTree.descend``: (full nodes after the start, tokens
        matched to the last of them, the partly matched node and its common tokens).
        ``key`` is a C-contiguous int32 array.
        """
        return descend(self.root if node is None else node, self.ps, key, n, pos)

    def match_walk(self, key: np.ndarray, n: int) -> tuple[list[SwaNode], int, SwaNode | None, int]:
        """The longest *window-valid* cached prefix of ``key[:n]``, changing nothing.

        Like ``descend``, cut back to the last point where a match may end: the path has
        no tombstone, or the tokens since the last tombstone number at least ``window``.
        """
        path, pos, partial, common = self.descend(key, n)
        if not self.tombstones:
            return path, pos, partial, common
        w = self.window
        since = 0  # tokens since the last tombstone, reset at every one
        seen = False  # a tombstone on the path so far
        best_k = best_pos = 0
        at = 0
        for k, node in enumerate(path, 1):
            at += node.ntok
            if node.tombstone:
                since, seen = 0, True
                continue
            since += node.ntok
            if not seen or since >= w:
                best_k, best_pos = k, at
        valid_partial = not seen or since + common >= w
        if partial is not None and not partial.tombstone and valid_partial:
            return path, pos, partial, common
        if best_k == len(path):
            return path, pos, None, 0
        return path[:best_k], best_pos, None, 0

    def valid_end(self, node: SwaNode, acc: int = 0) -> bool:
        """May a match end at ``node``'s end (its last window, or whole path, has SWA KV)?

        ``acc``: tokens with SWA KV already known to follow ``node``'s end.
        """
        w, root = self.window, self.root
        if acc >= w:
            return True
        while node is not root:
            if node.tombstone:
                return False
            acc += node.ntok
            if acc >= w:
                return True
            node = node.parent  # type: ignore[assignment]
        return True

    def split(self, child: SwaNode, at: int) -> SwaNode:
        """Cut ``child`` after ``at`` tokens (whole pages); returns the new upper node.

        Both halves get copies. The lower half keeps the id (handles still end at the same
        point); the upper half takes the boundary mark (an SWA lock that stopped at the
        whole node stops at its top), the locks and the tombstone state.
        """
        ps = self.ps
        cut = at // ps
        parent = child.parent
        assert parent is not None and 0 < at < child.ntok and at % ps == 0
        upper = SwaNode(
            self._new_id(),
            parent,
            child.kb[: 4 * at],
            child.pages[:cut].copy(),
            child.states[:cut].copy() if child.states is not None else None,
            child.created,
        )
        upper.last_access = child.last_access
        upper.hits = child.hits
        upper.swa_access = child.swa_access
        upper.swa_hits = child.swa_hits
        upper.priority = child.priority
        upper.lock = child.lock
        upper.swa_lock = child.swa_lock
        upper.tombstone = child.tombstone
        if child.tombstone:
            self.tombstones += 1
        upper.mark, child.mark = child.mark, 0
        if child.states is not None:
            upper.term = page_terms(upper.states, upper.pages)
            child.term = (child.term - upper.term) & _MASK
            child.states = child.states[cut:].copy()
        else:
            self._unhashed.append(upper)
        child.kb = child.kb[4 * at :]
        child.ntok -= at
        child.pages = child.pages[cut:].copy()
        pb = 4 * ps
        parent.children[upper.kb[:pb]] = upper
        upper.children[child.kb[:pb]] = child
        child.parent = upper
        self.nodes[upper.id] = upper
        self._queue_swa(upper)
        return upper

    def take_match(
        self, path: list[SwaNode], pos: int, partial: SwaNode | None, common: int
    ) -> tuple[list[SwaNode], int]:
        """Make a ``match_walk`` result the match: split the partial node (no touch)."""
        if partial is not None:
            path.append(self.split(partial, common))
            pos += common
        return path, pos

    def touch(self, path: list[SwaNode]) -> None:
        """A match used ``path``: advance the clock, count a hit on each node (the full
        order) and on the nodes of its last window (the SWA order), requeue them."""
        self.tick += 1
        tick = self.tick
        every = self._swa_keyed_by_path
        for node in path:
            node.last_access = tick
            node.hits += 1
            if every and not node.swa_lock and not node.tombstone:
                self._queue_swa(node)
        if path:
            self._queue(path[-1])
            self._touch_window(path[-1], tick, hit=True)

    def _touch_window(self, node: SwaNode, tick: int, hit: bool) -> None:
        """Mark the SWA KV of the last ``window`` tokens ending at ``node`` as used."""
        w, root = self.window, self.root
        acc = 0
        while node is not root:
            node.swa_access = tick
            if hit:
                node.swa_hits += 1
            if not node.swa_lock and not node.tombstone:
                self._queue_swa(node)
            acc += node.ntok
            if acc >= w:
                return
            node = node.parent  # type: ignore[assignment]

    # ---- insert -------------------------------------------------------------------------
    def insert(
        self,
        key: np.ndarray,
        pages: np.ndarray,
        priority: int = 0,
        *,
        start: SwaNode | None = None,
        start_pos: int = 0,
        trusted: bool = False,
        owner: int = HELD,
        want_pages: bool = True,
    ) -> tuple[int, np.ndarray | None, SwaNode]:
        """Cache ``key`` (whole pages) backed by ``pages``, each with an SWA page and tagged
        ``owner`` (HELD for a request's row, LENT for a caller's slots).

        As ``RadixTree.insert``: duplicates of cached pages are freed, the rest become the
        tree's; returns (tokens already cached, the tree's pages for ``key`` or ``None``
        unless ``want_pages``, the end node).
        A tombstone on the way whose pages the newcomer gives anew is revived: the
        newcomer's SWA pages move onto the tombstone's full pages and its own full pages
        are freed as duplicates. So the full pages, hashes and events of the block do not
        change (other requests may hold those full pages locked), and a later prefill
        matches past it. Unless ``trusted``, raises ``InvalidSlots`` before any change
        for pages not ``owner``'s, or when the new leaf could never be matched (it would follow
        a tombstone that the given pages cannot revive by less than a window).
        """
        ps = self.ps
        n = key.size
        path, pos, partial, common = self.descend(key, n, start, start_pos)
        have = pos + common
        k0 = start_pos // ps
        k = have // ps
        revive: list[tuple[SwaNode, int]] = []
        revive_partial = False
        if k > k0:  # the tree's pages where the walk went, and the given ones that differ
            pieces = [p.pages for p in path]
            if partial is not None:
                pieces.append(partial.pages[: common // ps])
            known = join_pages(pieces) if len(pieces) > 1 else pieces[0]
            given = pages[k0:k]
            differ = given != known
            dups = given[differ]
            if self.tombstones:
                revive, revive_partial = self._revivable(path, partial, differ)
        else:
            known = dups = _EMPTY_PAGES
        fresh = pages[k:]
        if not trusted:
            mine = np.concatenate((dups, fresh)) if dups.size else fresh
            try:
                self.alloc.full.check_owned(mine, owner)
            except Exception as exc:
                raise InvalidSlots(f"cannot insert: {exc}") from None
            top = start or self.root
            if (
                have < n
                and self.tombstones
                and not self._new_leaf_valid(
                    top, path, partial, common, revive, revive_partial, n - have
                )
            ):
                raise InvalidSlots(
                    "cannot insert: the new leaf would follow a tombstone by less than the"
                    f" window ({self.window} tokens) and the given pages cannot revive it"
                )

        if partial is not None:
            path.append(self.split(partial, common))
            if revive_partial:
                revive.append((path[-1], k - k0 - common // ps))
        for node, off in revive:
            self._revive(node, pages[k0 + off : k0 + off + node.pages.size])
        end = path[-1] if path else (start or self.root)
        self.tick += 1
        tick = self.tick
        node = end
        root = self.root
        every = self._swa_keyed_by_path
        while node is not root:
            # Touch the whole path: a request's locked prefix is being used too.
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
                if not node.swa_lock and not node.tombstone:
                    self._queue_swa(node)
            elif every and not node.swa_lock and not node.tombstone:
                self._queue_swa(node)
            node = node.parent  # type: ignore[assignment]
        if dups.size:
            self.alloc.free(dups, owner, checked=False)
        if have < n:
            end = self._add_child(end, key[have:], fresh.copy(), priority, owner)
        else:
            self._queue(end)
        if end is not root:
            self._touch_window(end, tick, hit=False)
        if not want_pages:
            return have, None, end
        parts = [pages[:k0], known] if k0 else [known]
        if have < n:
            parts.append(end.pages)
        return have, join_pages(parts), end

    def _revivable(
        self, path: list[SwaNode], partial: SwaNode | None, differ: np.ndarray
    ) -> tuple[list[tuple[SwaNode, int]], bool]:
        """Tombstones on the insert path whose every page the newcomer gives anew, with
        their page offsets after the start; and whether the partial node's matched part
        (its upper half once split) is one."""
        out: list[tuple[SwaNode, int]] = []
        off = 0
        for node in path:
            size = node.pages.size
            if node.tombstone and differ[off : off + size].all():
                out.append((node, off))
            off += size
        in_partial = partial is not None and partial.tombstone and bool(differ[off:].all())
        return out, in_partial

    def _new_leaf_valid(
        self,
        top: SwaNode,
        path: list[SwaNode],
        partial: SwaNode | None,
        common: int,
        revive: list[tuple[SwaNode, int]],
        revive_partial: bool,
        tail: int,
    ) -> bool:
        """Would a new leaf of ``tail`` tokens at the end of this insert be a valid end?"""
        w = self.window
        acc = tail
        if acc >= w:
            return True
        if partial is not None:
            if partial.tombstone and not revive_partial:
                return False
            acc += common
            if acc >= w:
                return True
        revived = {node.id for node, _ in revive}
        for node in reversed(path):
            if node.tombstone and node.id not in revived:
                return False
            acc += node.ntok
            if acc >= w:
                return True
        return self.valid_end(top, acc)

    def _revive(self, node: SwaNode, given: np.ndarray) -> None:
        self.alloc.move_swa(given, node.pages)
        node.tombstone = False
        size = node.pages.size
        self.tombstones -= 1
        self.tombstone_pages -= size
        self.swa_pages += size
        self._queue_swa(node)

    def _add_child(
        self, parent: SwaNode, key: np.ndarray, pages: np.ndarray, priority: int, owner: int
    ) -> SwaNode:
        """A new leaf under ``parent``: ``key`` (int32, copied into the node), ``pages``
        (the node's own array from now on), tagged ``owner`` until now."""
        node = SwaNode(self._new_id(), parent, key_bytes(key), pages, None, self.tick)
        node.priority = priority
        parent.children[node.kb[: 4 * self.ps]] = node
        self.nodes[node.id] = node
        self.alloc.retag(pages, owner, CACHED, checked=False)
        self.cached_pages += pages.size
        self.swa_pages += pages.size
        defer_hash(self, node, now=self.record_events)  # events need the hashes now
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
        self._queue(node)
        self._queue_swa(node)
        return node

    def _new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    # ---- whole-tree views -----------------------------------------------------------------
    def walk(self) -> list[SwaNode]:
        """Every node but the root, parents before children, children in key order."""
        out: list[SwaNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out
