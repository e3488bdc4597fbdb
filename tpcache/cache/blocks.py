"""The cache's contents as KV-event blocks: what a router's index should hold."""

from __future__ import annotations

from tpcache.cache.namespace import is_anchor
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.node import hash_pending


def cached_blocks(cache) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """Every cached block: hash -> (parent hash or None, its page's token ids).

    Walks the whole tree (a test and snapshot tool, not for a hot path). Works for any
    cache whose ``tree`` has ``walk()`` and nodes with ``key`` and ``states``.
    """
    ps = cache.page_size
    hash_pending(cache.tree)
    out: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for node in cache.tree.walk():
        if is_anchor(node):  # a namespace's anchor: no block of its own
            continue
        hashes = block_hashes(node.states).tolist()
        parent = node.parent
        prev = int(block_hashes(parent.states[-1:])[0]) if parent.states.size else None
        tokens = node.key.tolist()
        for i, h in enumerate(hashes):
            out[h] = (prev, tuple(tokens[i * ps : (i + 1) * ps]))
            prev = h
    return out
