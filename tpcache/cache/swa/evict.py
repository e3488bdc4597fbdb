"""The second eviction order of the windowed tree (``SwaTree``): SWA KV.

- Full order (``RadixTree.evict``): unlocked leaves. Evicting one frees its full and SWA
  pages and deletes it.
- SWA order (here): every node alive with SWA KV that is not SWA-locked, leaf or inner.
  Evicting a leaf deletes it (a tombstone may not be a leaf); evicting an inner node
  frees only its SWA pages and makes it a tombstone. Leaves below it that end less than
  a window after it could no longer be matched, so they go with it (they are never
  locked: a lock on one would SWA-lock the tombstoned node too).

The SWA order has its own recency: a node's SWA KV is used when the node lies in the
last window of a match or an insert (``swa_access``, ``swa_hits``), not whenever a path
runs through it, so a shared prefix far from where requests end loses its SWA KV first
and keeps its full KV. ``swa_policy_key`` gives the policy's SWA key.

Events: a block is announced removed when a request can no longer end a match in it,
so a router that counts cached blocks never counts more than a match would reuse: when
its node is tombstoned (its full KV stays, for matches that run through it) or, for a
node never tombstoned, when it is deleted. Revival announces the blocks stored again
(``inserts.revive_tombstones``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.events import BlockRemoved
from tpcache.cache.keys import join_pages
from tpcache.cache.policy.policies import KeyFn
from tpcache.cache.tree.evict import delete
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.shapes import Freed, SwaTreeShape

if TYPE_CHECKING:
    from tpcache.cache.tree.node import SwaNode

# The policies of ``policies.py`` with the SWA recency in place of the node's recency.
SWA_POLICY_KEYS: dict[str, KeyFn] = {
    "lru": lambda n: (n.swa_access, n.id),
    "mru": lambda n: (-n.swa_access, n.id),
    "fifo": lambda n: (n.created, n.id),
    "filo": lambda n: (-n.created, n.id),
    "lfu": lambda n: (n.swa_hits, n.swa_access, n.id),
    "priority": lambda n: (n.priority, n.swa_access, n.id),
}


def swa_policy_key(name: str) -> KeyFn:
    """The SWA order's key of policy ``name`` (one of ``policies.POLICIES``)."""
    return SWA_POLICY_KEYS[name]


def evict_window(tree: SwaTreeShape, num_pages: int, out: Freed) -> None:
    """Evict from the SWA order until ``out`` has freed ``num_pages`` SWA pages (what the
    full order freed first counts) or the order runs dry."""
    pop = tree.swa_order.pop
    while out.swa < num_pages:
        node = pop()
        if node is None:
            return
        if node.swa_lock or node.tombstone or not node.alive:  # no free SWA KV any more
            continue
        if node.children:
            tombstone(tree, node, out)
        else:
            assert node.lock == 0, f"leaf {node.id} locked but not SWA-locked"
            delete(tree, node, out)


def tombstone(tree: SwaTreeShape, node: SwaNode, out: Freed) -> None:
    """Drop the SWA KV of inner ``node``; delete the leaves it leaves unmatchable."""
    size = node.pages.size
    node.tombstone = True
    tree.swa_pages -= size
    tree.tombstones += 1
    tree.tombstone_pages += size
    tree.tombstoned_nodes += 1
    out.swa += size
    out.tombs.append(node)
    if tree.record_events:
        hashes = block_hashes(node.states).tolist()
        tree.events.append(BlockRemoved(block_hashes=hashes, medium=tree.medium))
    w = tree.window
    doomed: list[SwaNode] = []
    stack = [(node, 0)]
    while stack:
        cur, depth = stack.pop()
        for child in cur.children.values():
            d = depth + child.ntok
            if d >= w:
                continue
            if child.children:
                stack.append((child, d))
            else:
                doomed.append(child)
    for leaf in doomed:
        if leaf.alive:
            delete(tree, leaf, out)


def live_tombstone_pages(out: Freed) -> np.ndarray:
    """The full pages of the nodes ``out`` tombstoned that are still alive (whose SWA
    pages alone go back; a node deleted after it was tombstoned is freed whole)."""
    tombs = [n.pages for n in out.tombs if n.alive]
    if not tombs:
        return np.zeros(0, dtype=np.int64)
    return tombs[0] if len(tombs) == 1 else join_pages(tombs)
