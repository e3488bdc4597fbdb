"""The radix-tree nodes and the walks every tree shares.

``Node`` is one run of cached pages; ``SwaNode`` adds the sliding window's fields
(``host/node.py``'s ``HostNode`` the host tier's).
``descend`` is the lookup, ``window_cut`` cuts it back where a window forbids a match
end; ``split_node`` cuts a node in two; ``page_terms`` and the ``*_hash`` helpers compute the block-hash chain states and
digest terms, lazily (a replay that never asks for a digest never hashes).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Generic, NamedTuple, Self, TypeVar

import numpy as np

from tpcache.cache.tree.hashing import ROOT_STATE

EMPTY_PAGES = np.zeros(0, dtype=np.int64)
pages_of = operator.attrgetter("pages")  # a node's pages, without a Python frame per node
term_of = operator.attrgetter("term")
EMPTY_STATES = np.zeros(0, dtype=np.uint64)
_K = 0xA24BAED4963EE407  # odd
MASK = (1 << 64) - 1


def page_terms(states: np.ndarray, pages: np.ndarray) -> int:
    """Digest terms of cached pages: the sum of ``state * (page + K)`` mod 2**64, so it
    covers each block (its chain state) with its page id; additive over pages. Two numpy
    calls."""
    p = pages.view(np.uint64) if pages.dtype == np.int64 else pages.astype(np.uint64)
    return (int(states @ p) + _K * int(np.add.reduce(states))) & MASK


def seed_of(tree, node) -> int:
    """The chain state the first blocks below ``node`` (the root, or a namespace's anchor:
    ``anchors.py``) hash from."""
    return ROOT_STATE if node is tree.root else tree.spaces[node.kb][1]


NodeT = TypeVar("NodeT", bound="Node")  # a tree's node class: ``Node`` or a kind's


class Match(NamedTuple, Generic[NodeT]):
    """Where a walk of a key stopped (``descend``; ``RadixTree.match_walk``): the nodes
    matched whole (``path``), the tokens up to the end of the last of them (``pos``), the
    node where the walk stops part-way (``partial``, ``None`` if none) and how many of
    its tokens match (``common``, whole pages)."""

    path: list[NodeT]
    pos: int
    partial: NodeT | None
    common: int

    @property
    def end(self) -> int:
        """Tokens matched in all."""
        return self.pos + self.common


def descend(node: Any, ps: int, key: np.ndarray, n: int, pos: int) -> Match:
    """The walk behind ``RadixTree.descend`` (``children`` keyed by first-page bytes,
    ``kb`` the node's token bytes): one dict probe and one byte comparison per node, a
    vectorised compare where it diverges."""
    path = []
    if pos >= n:
        return Match(path, pos, None, 0)
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
            return Match(path, b // 4, child, (end - b) // 4)
        pos = b // 4
        ck = np.frombuffer(kb, dtype=np.int32)
        m = min(ck.size, n - pos)
        common = int((key[pos : pos + m] == ck[:m]).argmin()) // ps * ps
        return Match(path, pos, child, common)
    return Match(path, b // 4, None, 0)


def window_cut(path: list[Any], pos: int, partial: Any, common: int, window: int) -> Match:
    """A ``descend`` result cut back to where a match may end in a tree with tombstones
    (``SwaNode``): the path has no tombstone, or the tokens since the last tombstone
    number at least ``window``. The count restarts at every tombstone."""
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
        if not seen or since >= window:
            best_k, best_pos = k, at
    valid_partial = not seen or since + common >= window
    if partial is not None and not partial.tombstone and valid_partial:
        return Match(path, pos, partial, common)
    if best_k == len(path):
        return Match(path, pos, None, 0)
    return Match(path[:best_k], best_pos, None, 0)


def defer_hash(tree, node, now: bool) -> None:
    """Hash ``node`` now, or remember it for ``hash_pending`` (any tree with ``root``,
    ``hasher``, ``nodes``, ``digest_sum`` and ``unhashed``)."""
    if now:
        hash_node(tree, node)
        return
    tree.unhashed.append(node)
    if len(tree.unhashed) > 2 * len(tree.nodes) + 1024:
        # Drop evicted nodes, so a cache nobody asks for a digest keeps no dead node
        # alive (amortised O(1) per insert).
        tree.unhashed = [n for n in tree.unhashed if n.alive and n.states is None]


def hash_pending(tree) -> None:
    """Hash every node still waiting (parents first); see ``RadixTree.ensure_hashed``.

    Nodes whose parents are hashed go together (``hash_nodes``), level by level: a TP
    rank asks for a digest every step, after a few short new leaves.
    """
    pending, tree.unhashed = tree.unhashed, []
    if len(pending) <= 1:  # most steps add one leaf: hash_node walks up to a hashed parent
        if pending and pending[0].alive and pending[0].states is None:
            hash_node(tree, pending[0])
        return
    # Each node once, in order: a node listed twice must not add its term twice.
    todo = list(dict.fromkeys(n for n in pending if n.alive and n.states is None))
    while todo:
        ready = [n for n in todo if n.parent.states is not None]
        if ready:
            hash_nodes(tree, ready)
        else:  # an unhashed ancestor that is not in the list: hash it through the chain
            hash_node(tree, todo[0])
        todo = [n for n in todo if n.states is None]


_BATCH_PAGES = 4096  # pages hashed in one batch: bounds the hasher's power tables
_FEW_PAGES = 4  # up to this many pages a node is hashed in Python ints (chain_few)


def hash_nodes(tree, nodes: list) -> None:
    """Chain states and digest terms of ``nodes``, whose parents are all hashed, in
    batches of about ``_BATCH_PAGES`` pages (``PageHasher.chain_runs``)."""
    pb = 4 * tree.hasher.page_size
    batch: list = []
    sizes: list[int] = []
    pages = 0
    for node in nodes:
        size = len(node.kb) // pb
        if batch and pages + size > _BATCH_PAGES:
            _hash_batch(tree, batch, sizes)
            batch, sizes, pages = [], [], 0
        batch.append(node)
        sizes.append(size)
        pages += size
    if batch:
        _hash_batch(tree, batch, sizes)


def _hash_batch(tree, batch: list, sizes: list[int]) -> None:
    if len(batch) == 1:
        hash_node(tree, batch[0])
        return
    firsts = [0, *itertools.accumulate(sizes[:-1])]
    parents = np.array(
        [
            int(n.parent.states[-1]) if n.parent.states.size else seed_of(tree, n.parent)
            for n in batch
        ],
        dtype=np.uint64,
    )
    key = np.frombuffer(b"".join(n.kb for n in batch), dtype=np.int32)
    # page_terms of every node at once: sum of state * (page + K) over each node's pages.
    pages = np.concatenate([n.pages for n in batch]).view(np.uint64)
    if pages.size == len(batch):  # one page each (a step's new leaves, most often)
        states = tree.hasher.chain_pages(key, parents)
        terms = (states * (pages + np.uint64(_K))).tolist()
    else:
        starts = np.array(firsts, dtype=np.int64)
        states = tree.hasher.chain_runs(key, starts, np.array(sizes, dtype=np.int64), parents)
        terms = np.add.reduceat(states * (pages + np.uint64(_K)), starts).tolist()
    total = tree.digest_sum
    for n, a, m, term in zip(batch, firsts, sizes, terms, strict=True):
        n.states = states[a : a + m].copy()  # own arrays: no node pins the batch's
        n.term = term
        total += term
    tree.digest_sum = total & MASK


def hash_node(tree, node) -> None:
    """Chain states and digest terms of ``node`` and of its unhashed ancestors."""
    chain = []
    root = tree.root
    while node is not root and node.states is None:
        chain.append(node)
        node = node.parent
    hasher = tree.hasher
    total = tree.digest_sum
    for n in reversed(chain):
        parent = n.parent
        parent_state = int(parent.states[-1]) if parent.states.size else seed_of(tree, parent)
        if n.pages.size <= _FEW_PAGES:
            states = hasher.chain_few(n.kb, parent_state)
            # page_terms in Python ints: sum(state * (page + K)), the two sums in C
            n.term = (sum(map(operator.mul, states, n.pages.tolist())) + _K * sum(states)) & MASK
            n.states = np.array(states, dtype=np.uint64)
        else:
            n.states = hasher.chain(np.frombuffer(n.kb, dtype=np.int32), parent_state)
            n.term = page_terms(n.states, n.pages)
        total += n.term
    tree.digest_sum = total & MASK


class Node:
    """One run of cached pages. Owned and mutated only by its ``RadixTree``; the sliding
    window's node (``SwaNode``) adds its fields to these."""

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
        "states",
        "term",
    )

    def __init__(
        self,
        node_id: int,
        parent: Self | None,  # None: the root
        key: bytes,
        pages: np.ndarray,
        states: np.ndarray | None,  # None until hashed (RadixTree.ensure_hashed)
        tick: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Self] = {}
        self.kb = key  # the int32 tokens, as bytes
        self.pages = pages
        self.states = states
        self.term = 0  # this node's share of the tree's digest_sum (page_terms)
        self.lock = 0  # requests whose locked path runs through this node
        self.last_access = tick
        self.created = tick
        self.hits = 0
        self.priority = 0
        self.alive = True

    @property
    def key(self) -> np.ndarray:
        """The node's tokens: a read-only int32 view of ``kb`` (no copy)."""
        return np.frombuffer(self.kb, dtype=np.int32)

    @key.setter
    def key(self, tokens: np.ndarray) -> None:
        self.kb = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()


class SwaNode(Node):
    """A node of the windowed tree: ``Node``'s fields and the window's. Owned and mutated
    only by ``swa_tree.SwaTree``."""

    __slots__ = ("mark", "ntok", "swa_access", "swa_hits", "swa_lock", "tombstone")

    def __init__(self, *args: Any) -> None:  # as Node's
        super().__init__(*args)
        tick = self.created
        self.ntok = len(self.kb) >> 2  # how many tokens
        self.swa_lock = 0  # locks whose last window covers this node (SWA KV in use)
        self.tombstone = False  # SWA KV dropped; full KV kept
        self.mark = 0  # boundary mark of SWA locks that stop here; 0: none given out
        self.swa_access = tick  # last use of its SWA KV (it was in a match's last window)
        self.swa_hits = 0


def split_node(tree: Any, child: NodeT, at: int) -> NodeT:
    """Cut ``child`` of ``tree`` after ``at`` tokens (whole pages); returns the new upper
    node, registered in the tree.

    Both halves get copies, so a short node never pins a long freed array. The
    lower half keeps the id, so a handle to it still ends at the same point.
    """
    ps = tree.ps
    cut = at // ps
    parent = child.parent
    assert parent is not None and 0 < at < len(child.kb) // 4 and at % ps == 0
    hashed = child.states is not None
    node_id = tree.new_node_id()
    upper = tree.node_type(
        node_id,
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
        child.term = (child.term - upper.term) & MASK
        child.states = child.states[cut:].copy()
    else:
        tree.unhashed.append(upper)
    child.kb = child.kb[4 * at :]
    child.pages = child.pages[cut:].copy()
    pb = 4 * ps
    parent.children[upper.kb[:pb]] = upper
    upper.children[child.kb[:pb]] = child
    child.parent = upper
    tree.nodes[upper.id] = upper
    return upper
