"""Inserts over host-only nodes: a request (or a caller of ``insert``) computed tokens
the host tier holds, so the nodes it walks over get its device pages, top-down (the
device tier stays closed under parents); the rest is the base insert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tpcache.cache.allocator import LENT
from tpcache.cache.errors import InvalidSlots
from tpcache.cache.host.moves import to_device
from tpcache.cache.keys import join_pages
from tpcache.cache.tree.node import pages_of
from tpcache.errors import TpcacheError

if TYPE_CHECKING:
    from tpcache.cache.tree.shapes import HostTreeShape


def revive(
    tree: HostTreeShape, key: np.ndarray, pages: np.ndarray, start: Any, start_pos: int, owner: int
) -> None:
    """Give the host-only nodes that caching ``key`` (pages ``pages``, tagged ``owner``;
    ``start`` ends at ``key[:start_pos]``) walks over the given device pages, top-down."""
    ps = tree.ps
    if (
        not tree.host_only_pages()
        or key[start_pos : start_pos + ps].tobytes() not in start.children
    ):
        return  # nothing host-only, or no node to walk over (``descend``'s first probe)
    path, _, partial, common = tree.descend(key, key.size, start, start_pos)
    if partial is not None and not partial.dev:
        path.append(tree.split(partial, common))
    at = start_pos // ps
    for node in path:
        n = node.pages.size
        if not node.dev:
            to_device(tree, node, pages[at : at + n], owner)
        at += n


def check_lent(tree: HostTreeShape, key: np.ndarray, pages: np.ndarray, start: Any = None) -> None:
    """Raise ``InvalidSlots`` (nothing changed) unless every given page is the tree's
    device page at its place (below ``start``, a namespace's anchor, or the root) or a
    page lent to the caller. Pure."""
    path, pos, partial, common = tree.descend(key, key.size, start)
    pieces = list(map(pages_of, path))
    if partial is not None:
        pieces.append(partial.pages[: common // tree.ps])
    k = (pos + common) // tree.ps
    known = join_pages(pieces) if pieces else np.zeros(0, np.int64)
    mine = np.concatenate((pages[:k][pages[:k] != known], pages[k:]))
    try:
        tree.alloc.check_owned(mine, LENT)
    except TpcacheError as exc:
        raise InvalidSlots(f"cannot insert: {exc}") from None
