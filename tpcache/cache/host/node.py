"""``HostNode``: a node of the host tier's tree (``host/tree.py``), with its tier."""

from __future__ import annotations

from typing import Any

from tpcache.cache.tree.node import EMPTY_PAGES, Node


class HostNode(Node):
    """A node of the tiered tree: ``Node``'s fields and its tier. Owned and mutated only
    by ``host.tree.HostTree`` and ``host/moves.py``."""

    __slots__ = ("dev", "host", "pinned")

    def __init__(self, *args: Any) -> None:  # as Node's
        Node.__init__(self, *args)
        self.dev = True  # ``pages`` are device pages (else host ids + offset)
        self.host = EMPTY_PAGES  # host pages holding a copy (all or none of them)
        self.pinned = False  # being loaded by an admit: no host eviction takes it
