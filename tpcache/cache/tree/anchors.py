"""A tree's namespace anchors (``namespace.py``): zero-page nodes under the root, one per
namespace in use, below which that namespace's prefixes are cached.

An anchor holds no page, the base lock 1 (and, with a window, the base SWA lock 1), so
it is never an eviction candidate and never tombstoned; the locks of requests below it
add to it as to any ancestor. It exists exactly while it has children: it is made by
the first insert below it and deleted by the eviction that deletes its last child
(``evict.delete``; with a host tier, the host pool's eviction or a drop of a node without
host room: ``host_moves.py``), so nothing leaks. No event announces it; its namespace shows in the
events of the blocks below it (``lora_id``, ``lora_name``) and in their hashes, whose
chain starts from the namespace's seed. The digest covers it through the node count and
those hashes: two ranks that applied the same ops have the same anchors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpcache.cache.allocator import LENT
from tpcache.cache.errors import AllocatorError, IntegrityError, InvalidSlots
from tpcache.cache.namespace import CacheNamespace, as_namespace, is_anchor
from tpcache.cache.tree.node import Match

if TYPE_CHECKING:
    import numpy as np

    from tpcache.cache.tree.node import Node
    from tpcache.cache.tree.shapes import TreeShape

BASE_LOCK = 1  # an anchor's own lock (full, and SWA with a window)


def anchor_of(tree: TreeShape, space: CacheNamespace, create: bool = False) -> Node | None:
    """The anchor of ``space`` in ``tree``; ``None`` if it has none and not ``create``."""
    key = space.key
    node = tree.root.children.get(key)
    if node is None and create:
        node = tree.new_anchor(key)
        tree.spaces[key] = (space, space.seed)
    return node


def drop_anchor(tree: TreeShape, node: Node) -> None:
    """Delete anchor ``node``: it just lost its last child, and only its base lock is
    left (a request below it would have kept a locked child)."""
    assert not node.children and node.lock == BASE_LOCK, f"anchor {node.id} still in use"
    del tree.root.children[node.kb]
    del tree.nodes[node.id]
    del tree.spaces[node.kb]
    node.alive = False


def namespace_of(tree: TreeShape, node: Node) -> CacheNamespace | None:
    """The namespace ``node`` is cached in (``None``: the default one). O(depth)."""
    if not tree.spaces:
        return None
    root = tree.root
    while node is not root and node.parent is not root:
        node = node.parent  # type: ignore[assignment]
    found = tree.spaces.get(node.kb)
    return None if found is None else found[0]


def match_in(
    tree: TreeShape, key: np.ndarray, n: int, namespace: Any
) -> tuple[CacheNamespace | None, Match]:
    """The namespace checked (``as_namespace``; ``None``: the default one) and the match
    of ``key[:n]`` in it (``RadixTree.match_walk``; nothing where it has no anchor).
    Changes nothing; raises ``InvalidNamespace``."""
    if namespace is None:  # the default namespace, most calls: no check to make
        return None, tree.match_walk(key, n)
    space = as_namespace(namespace)
    if space is None:
        return None, tree.match_walk(key, n)
    start = anchor_of(tree, space)
    return space, Match([], 0, None, 0) if start is None else tree.match_walk(key, n, start)


def insert_start(tree: TreeShape, node: Node, space: CacheNamespace | None, grow: bool) -> Node:
    """Where a request's insert walks from: its locked ``node``, or, for a request in
    ``space`` that matched nothing (its node is the root), the namespace's anchor, made
    now if the insert will ``grow`` the tree (so no anchor is ever left childless)."""
    if space is None or node is not tree.root or not grow:
        return node
    anchor = anchor_of(tree, space, create=True)
    assert anchor is not None  # made if missing
    return anchor


def lent_insert_start(tree: TreeShape, namespace: Any, pages: np.ndarray) -> Node | None:
    """Where a caller's insert of lent ``pages`` in ``namespace`` walks from: ``None`` (the
    root) for the default namespace, else its anchor, made only once the pages are known
    to be the caller's (without an anchor, the insert caches all of them as a new leaf),
    so a refused insert leaves no anchor and takes no node id. Raises ``InvalidSlots``,
    ``InvalidNamespace``."""
    space = as_namespace(namespace)
    if space is None:
        return None
    found = anchor_of(tree, space)
    if found is None and pages.size:
        try:
            tree.alloc.check_owned(pages, LENT)
        except AllocatorError as exc:
            raise InvalidSlots(f"cannot insert: {exc}") from None
        found = anchor_of(tree, space, create=True)
    return found


def check_anchor(tree: TreeShape, node: Node) -> None:
    """``check_integrity``'s part for an anchor: under the root by its whole key, known
    in ``spaces``, no pages, children, the base locks above its children's."""
    space = tree.spaces.get(node.kb)
    if node.parent is not tree.root or tree.root.children.get(node.kb) is not node:
        raise IntegrityError(f"anchor {node.id} is not under the root by its key")
    if space is None or space[0].key != node.kb or space[1] != space[0].seed:
        raise IntegrityError(f"anchor {node.id} is not a known namespace's")
    if node.pages.size or node.states is None or node.states.size:
        raise IntegrityError(f"anchor {node.id} holds {node.pages.size} pages")
    if tree.leaves.key_of(node) is not None:
        raise IntegrityError(f"anchor {node.id} is in the eviction queue")
    if not node.children:
        raise IntegrityError(f"anchor {node.id} has no children (it should be gone)")
    child_locks = sum(c.lock for c in node.children.values())
    if node.lock != BASE_LOCK + child_locks:
        raise IntegrityError(
            f"anchor {node.id} has lock {node.lock}, want {BASE_LOCK} + children's {child_locks}"
        )


def check_spaces(tree: TreeShape) -> None:
    """Every namespace in ``spaces`` has its anchor under the root."""
    anchors = sum(1 for k in tree.root.children if is_anchor_key(k))
    if anchors != len(tree.spaces):
        raise IntegrityError(f"{anchors} anchors under the root, {len(tree.spaces)} namespaces")


def is_anchor_key(key: bytes) -> bool:
    return bool(len(key) & 3)


__all__ = ["BASE_LOCK", "anchor_of", "check_anchor", "drop_anchor", "is_anchor"]
