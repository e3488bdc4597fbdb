"""Shared helpers of the tests/test_cache_*.py files (not a test module)."""

from __future__ import annotations

from tpcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tpcache.cache.radix import RadixCache
from tpcache.cache.tree.hashing import block_hashes

BlockIndex = dict[int, tuple[int | None, tuple[int, ...]]]  # hash -> (parent hash, page tokens)


def snapshot(cache: RadixCache) -> tuple[int, object]:
    """What a rejected call must leave unchanged."""
    return cache.digest(), cache.sizes()


def tree_nodes(cache: RadixCache) -> list[tuple[list[int], list[int], int]]:
    """(tokens, pages, lock) of every node, parents first, children in key order."""
    return [(n.key.tolist(), n.pages.tolist(), n.lock) for n in cache.tree.walk()]


def cached_prefixes(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached page-aligned prefix (as a token tuple) -> its page ids, from the tree."""
    ps = cache.page_size
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    prefix_of = {cache.tree.root.id: ((), ())}
    for node in cache.tree.walk():
        toks, pages = prefix_of[node.parent.id]
        for i in range(node.pages.size):
            toks = toks + tuple(node.key[i * ps : (i + 1) * ps].tolist())
            pages = (*pages, int(node.pages[i]))
            out[toks] = pages
        prefix_of[node.id] = (toks, pages)
    return out


def tree_block_index(cache: RadixCache) -> BlockIndex:
    """The cache's contents as block hash -> (parent hash, page tokens), read from the tree."""
    ps = cache.page_size
    index: BlockIndex = {}
    last: dict[int, int | None] = {cache.tree.root.id: None}
    for node in cache.tree.walk():
        parent = last[node.parent.id]
        for i, h in enumerate(block_hashes(node.states).tolist()):
            index[h] = (parent, tuple(node.key[i * ps : (i + 1) * ps].tolist()))
            parent = h
        last[node.id] = parent
    return index


def fold_events(index: BlockIndex, events: list[KVEvent], page_size: int) -> None:
    """Apply KV events to a reference index the way a router would, checking each one:
    a store names known parents and new hashes; a removal names exactly stored hashes."""
    for ev in events:
        match ev:
            case BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks):
                assert ev.block_size == page_size
                assert len(toks) == len(hashes) * page_size
                assert parent is None or parent in index, f"unknown parent {parent}"
                for i, h in enumerate(hashes):
                    assert h not in index, f"block {h} stored twice"
                    index[h] = (parent, tuple(toks[i * page_size : (i + 1) * page_size]))
                    parent = h
            case BlockRemoved(block_hashes=hashes):
                for h in hashes:
                    assert h in index, f"removal of {h}, never stored (or removed already)"
                    del index[h]
            case AllBlocksCleared():
                index.clear()
            case _:
                raise AssertionError(f"unexpected event {ev!r}")
