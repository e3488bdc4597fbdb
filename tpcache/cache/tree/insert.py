"""Caching a key in a tree: the one insert every cache kind uses.

The walk goes as far as the key is cached; pages of that part that differ from the
tree's are duplicates and go back to the allocator (with a window, they may revive a
tombstone instead: ``RadixTree.revivable`` and ``revive``); the rest becomes a new
leaf that takes over its pages, is hashed (now if events or a stateful policy need it,
else later) and announced (``BlockStored``). Every node on the path is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpcache.cache.allocator import CACHED, HELD
from tpcache.cache.errors import InvalidSlots
from tpcache.cache.events import stored_event
from tpcache.cache.keys import join_pages, key_bytes
from tpcache.cache.tree.anchors import namespace_of
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.node import EMPTY_PAGES, Node, defer_hash, descend, pages_of

if TYPE_CHECKING:
    from tpcache.cache.tree.shapes import TreeShape


def insert_key(
    tree: TreeShape,
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
    """Cache ``key`` (whole pages) in ``tree``, backed by ``pages`` (tagged ``owner``:
    HELD for a request's row, LENT for a caller's slots).

    Returns (tokens already cached, the tree's pages for the whole key or ``None``
    unless ``want_pages``, the node ending at ``key``). ``start``/``start_pos``: a node
    known to end at ``key[:start_pos]`` whose pages are ``pages[:start_pos // ps]`` (a
    request's locked prefix), so the walk begins there. Unless ``trusted`` (the caller's
    own request rows), every page is validated first and ``InvalidSlots`` is raised
    before anything changes (also for a new leaf that could never be matched).
    """
    # One function on purpose (82 lines with its docstring): every check must come before every change,
    # and both work on the same walk; split, the halves would pass eight values along.
    ps = tree.ps
    n = key.size
    path, pos, partial, common = descend(start or tree.root, ps, key, n, start_pos)
    have = pos + common
    k0 = start_pos // ps
    k = have // ps
    revive = None
    if k > k0:  # the tree's pages where the walk went, and the given ones that differ
        pieces = list(map(pages_of, path))
        if partial is not None:
            pieces.append(partial.pages[: common // ps])
        known = join_pages(pieces) if len(pieces) > 1 else pieces[0]
        given = pages[k0:k]
        differ = given != known
        dups = given[differ]
        revive = tree.revivable(path, partial, differ)
    else:
        known = dups = EMPTY_PAGES
    fresh = pages[k:] if k else pages  # no view to make when nothing was cached
    if not trusted:
        mine = np.concatenate((dups, fresh)) if dups.size else fresh
        try:
            tree.alloc.check_owned(mine, owner)
        except Exception as exc:
            raise InvalidSlots(f"cannot insert: {exc}") from None
        if have < n:
            tree.check_new_leaf(start or tree.root, path, partial, common, revive, n - have)

    if partial is not None:
        path.append(tree.split(partial, common))
    if revive:
        tree.revive(revive, path, pages[k0:k])
    end = path[-1] if path else (start or tree.root)
    tree.tick += 1
    tick = tree.tick
    node = end
    root = tree.root
    while node is not root:
        # Touch the whole path: a request's locked prefix is being used too.
        node.last_access = tick
        if priority > node.priority:
            node.priority = priority
            tree.reprioritised(node)
        node = node.parent
    if dups.size:
        tree.alloc.free(dups, owner, checked=False)
    if have < n:
        end = add_leaf(tree, end, key[have:] if have else key, fresh.copy(), priority, owner)
    else:
        tree.queue_candidate(end)
    if tree.window is not None:
        tree.inserted(end, tick, fresh.size)
    if not want_pages:
        return have, None, end
    parts = [pages[:k0], known] if k0 else [known]
    if have < n:
        parts.append(fresh)  # the new leaf's pages (a policy may have split it)
    return have, join_pages(parts), end


def add_leaf(
    tree: TreeShape, parent: Node, key: np.ndarray, pages: np.ndarray, priority: int, owner: int
) -> Node:
    """A new leaf under ``parent``: ``key`` (int32, copied into the node), ``pages`` (the
    node's own array from now on), tagged ``owner`` until now."""
    node_id = tree.new_node_id()
    node = tree.node_type(node_id, parent, key_bytes(key), pages, None, tree.tick)
    node.priority = priority
    parent.children[node.kb[: 4 * tree.ps]] = node
    tree.nodes[node.id] = node
    tree.alloc.retag(pages, owner, CACHED, checked=False)
    tree.cached_pages += pages.size
    # Events and stateful policies need the block hashes now; else they wait.
    defer_hash(tree, node, now=tree.record_events or tree.hooks is not None)
    if tree.record_events:
        parent_hash = int(block_hashes(parent.states[-1:])[0]) if parent.states.size else None
        space = namespace_of(tree, parent)
        hashes = block_hashes(node.states).tolist()
        tree.events.append(
            stored_event(hashes, parent_hash, key.tolist(), tree.ps, tree.medium, space)
        )
    if tree.hooks is not None:
        node = tree.hooks.on_insert(node)  # may split off an upper node
    tree.leaves.push(node)  # an unlocked leaf, alive
    return node
