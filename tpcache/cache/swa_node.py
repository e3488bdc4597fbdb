"""Nodes of the hybrid radix tree (``swa_tree.py``), and its lock error."""

from __future__ import annotations

import numpy as np

from tpcache.cache.errors import LockError

ROOT_MARK = 1  # the root's boundary mark: an SWA lock that runs up the whole path


class StaleBoundary(LockError):
    """An SWA lock boundary that no longer names a node on the handle's path."""


class SwaNode:
    """One run of cached pages of the hybrid tree. Owned and mutated only by ``SwaTree``."""

    __slots__ = (
        "alive",
        "children",
        "created",
        "hits",
        "id",
        "kb",
        "last_access",
        "lock",
        "mark",
        "ntok",
        "pages",
        "parent",
        "priority",
        "queued",
        "states",
        "swa_access",
        "swa_hits",
        "swa_lock",
        "swa_queued",
        "term",
        "tombstone",
    )

    def __init__(
        self,
        node_id: int,
        parent: SwaNode | None,
        key: bytes,
        pages: np.ndarray,
        states: np.ndarray | None,  # None until hashed (tree.hash_pending)
        tick: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, SwaNode] = {}
        self.kb = key  # the int32 tokens, as bytes
        self.ntok = len(key) >> 2  # how many tokens
        self.pages = pages  # int64 full pages; their SWA pages via the allocator's mapping
        self.states = states
        self.term = 0  # this node's share of the tree's digest_sum (page_terms)
        self.lock = 0  # locks whose path runs through this node (full KV in use)
        self.swa_lock = 0  # locks whose last window covers this node (SWA KV in use)
        self.tombstone = False  # SWA KV dropped; full KV kept
        self.mark = 0  # boundary mark of SWA locks that stop here; 0: none given out
        self.last_access = tick  # last use of the node (any match or insert through it)
        self.created = tick
        self.hits = 0
        self.swa_access = tick  # last use of its SWA KV (it was in a match's last window)
        self.swa_hits = 0
        self.priority = 0
        self.queued: tuple[int, ...] | None = None  # live key in the full (leaf) heap
        self.swa_queued: tuple[int, ...] | None = None  # live key in the SWA heap
        self.alive = True

    @property
    def key(self) -> np.ndarray:
        """The node's tokens: a read-only int32 view of ``kb`` (no copy)."""
        return np.frombuffer(self.kb, dtype=np.int32)
