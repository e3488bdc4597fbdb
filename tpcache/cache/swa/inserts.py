"""What an insert does about the window's tombstones (``SwaTree``'s insert hooks): find
the tombstones the newcomer's pages revive, refuse a new leaf that could never be
matched, and revive.

Why revival: a tombstone keeps its full KV, so a newcomer that computed the same tokens
again only has to give its SWA pages; they move onto the tombstone's full pages (the
newcomer's full pages are freed as duplicates), and full pages and block hashes stay as
they were. Its blocks were announced removed when it was tombstoned (``evict.py``), so
revival announces them stored again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpcache.cache.errors import InvalidSlots
from tpcache.cache.events import stored_event
from tpcache.cache.tree.anchors import namespace_of
from tpcache.cache.tree.hashing import block_hashes
from tpcache.cache.tree.node import SwaNode

if TYPE_CHECKING:
    import numpy as np

    from tpcache.cache.tree.shapes import SwaTreeShape

Revive = tuple[list[tuple[SwaNode, int]], bool]  # (tombstones, page offset), partial's too


def revivable(tree: SwaTreeShape, path: list[SwaNode], partial: Any, differ: np.ndarray) -> Revive:
    """Tombstones on the insert path whose every page the newcomer gives anew, with their
    page offsets after the start; and whether the partial node's matched part (its upper
    half once split) is one."""
    out: list[tuple[SwaNode, int]] = []
    if not tree.tombstones:
        return out, False
    off = 0
    for node in path:
        size = node.pages.size
        if node.tombstone and differ[off : off + size].all():
            out.append((node, off))
        off += size
    in_partial = partial is not None and partial.tombstone and bool(differ[off:].all())
    return out, in_partial


def check_new_leaf(
    tree: SwaTreeShape,
    top: SwaNode,
    path: list[SwaNode],
    partial: SwaNode | None,
    common: int,
    revive: Revive | None,
    tail: int,
) -> None:
    """Refuse (``InvalidSlots``) a new leaf that would follow a tombstone the given pages
    do not revive by less than a window: it could never be matched."""
    if not tree.tombstones:
        return
    nodes, revive_partial = revive or ([], False)
    revived = {node.id for node, _ in nodes}
    # (tokens, a tombstone that stays) of what lies above the new leaf, nearest first.
    above = [(n.ntok, n.tombstone and n.id not in revived) for n in reversed(path)]
    if partial is not None:
        above.insert(0, (common, partial.tombstone and not revive_partial))
    acc = tail
    for ntok, dead in above:
        if acc >= tree.window:
            return
        if dead:
            break
        acc += ntok
    else:
        if tree.valid_end(top, acc):
            return
    raise InvalidSlots(
        "cannot insert: the new leaf would follow a tombstone by less than the"
        f" window ({tree.window} tokens) and the given pages cannot revive it"
    )


def revive_tombstones(
    tree: SwaTreeShape, revive: Revive, path: list[SwaNode], given: np.ndarray
) -> None:
    """Give the tombstones ``revivable`` found the SWA pages of ``given`` (the walked
    part's pages, in path order)."""
    nodes, revive_partial = revive
    if revive_partial:  # path[-1] is the partial node's upper half now
        nodes = [*nodes, (path[-1], given.size - path[-1].pages.size)]
    for node, off in nodes:
        tree.alloc.move_swa(given[off : off + node.pages.size], node.pages)
        node.tombstone = False
        size = node.pages.size
        tree.tombstones -= 1
        tree.tombstone_pages -= size
        tree.swa_pages += size
        tree.queue_swa(node)
        if tree.record_events:  # its blocks were announced removed when tombstoned
            announce_stored(tree, node)


def announce_stored(tree: SwaTreeShape, node: SwaNode) -> None:
    """Announce revived ``node``'s blocks stored again (as its insert did)."""
    parent = node.parent
    parent_hash = int(block_hashes(parent.states[-1:])[0]) if parent.states.size else None
    hashes = block_hashes(node.states).tolist()
    tokens = node.key.tolist()
    space = namespace_of(tree, node)
    tree.events.append(stored_event(hashes, parent_hash, tokens, tree.ps, tree.medium, space))
