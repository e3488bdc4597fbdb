"""The handles a cache gives out for matched prefixes, and the locks they hold.

A handle names a node (and, with a window, the boundary mark where its SWA lock stops)
and the cache generation that made it: another cache's handle, one from before a reset,
or a forged one is refused. ``lock()`` calls are counted per handle, so a handle's
unlock can never take a lock a running request holds on the same node.
"""

from __future__ import annotations

from typing import Any

from tpcache.cache.errors import IntegrityError, LockError, UnknownHandle
from tpcache.cache.records import Handle, new_owner
from tpcache.cache.swa_config import SwaHandle


class HandleLocks:
    """One cache generation's handles and their locks. Owned by the cache, which makes a
    new one at every reset (a new ``owner``: older handles name nothing).

    ``locks``: (node id, boundary mark) -> ``lock()`` calls not yet undone.
    """

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.owner = new_owner()
        self.windowed = tree.window is not None  # then handles carry the boundary mark
        self.locks: dict[tuple[int, int], int] = {}

    def make(self, node: Any) -> Handle:
        """A handle to ``node`` (with a window: and the boundary of its last window, which
        may give a node its mark)."""
        if not self.windowed:
            return Handle(node.id, self.owner)
        tree = self.tree
        return SwaHandle(node.id, self.owner, tree.mark_of(tree.boundary(node)))

    def resolve(self, handle: Handle) -> tuple[Any, Any, int]:
        """(node, window top, mark) of a handle of this generation. Raises
        ``UnknownHandle`` or ``StaleBoundary`` (its mark is not on its path)."""
        if (
            type(handle) is not (SwaHandle if self.windowed else Handle)
            or type(handle.node_id) is not int
            or (self.windowed and type(handle.swa_boundary) is not int)  # type: ignore[attr-defined]
        ):
            raise UnknownHandle(f"not a handle of this cache: {handle!r}")
        if handle.owner != self.owner:
            raise UnknownHandle(
                f"handle {handle.node_id} was given out by another cache, or before a reset"
            )
        node = self.tree.nodes.get(handle.node_id)
        if node is None:
            raise UnknownHandle(
                f"handle {handle.node_id} names no cached node (evicted or foreign)"
            )
        mark = handle.swa_boundary if self.windowed else 0  # type: ignore[attr-defined]
        return node, self.tree.find_top(node, mark), mark

    def lock(self, handle: Handle) -> None:
        """Lock the prefix of ``handle``; raises (changing nothing) as ``resolve`` does, or
        ``LockError`` if its window lost SWA KV since the match."""
        node, top, mark = self.resolve(handle)
        self.tree.check_lockable(node, top)
        self.tree.lock(node, top)
        key = (node.id, mark)
        self.locks[key] = self.locks.get(key, 0) + 1

    def unlock(self, handle: Handle) -> None:
        """Undo one ``lock(handle)``; raises (changing nothing) as ``resolve`` does, or
        ``LockError`` if this handle holds no lock."""
        node, top, mark = self.resolve(handle)
        key = (node.id, mark)
        held = self.locks.get(key, 0)
        if held == 0:
            raise LockError(f"handle {node.id} is not locked (by lock())")
        self.tree.unlock(node, top)
        if held == 1:
            del self.locks[key]
        else:
            self.locks[key] = held - 1

    def holders(self) -> list[tuple[Any, int, int]]:
        """(node, mark, count) of every held lock, for ``check_integrity``; a lock on a node
        that is gone raises ``IntegrityError``."""
        out = []
        for (node_id, mark), count in self.locks.items():
            node = self.tree.nodes.get(node_id)
            if node is None:
                raise IntegrityError(f"handle {node_id} holds {count} locks on a node that is gone")
            out.append((node, mark, count))
        return out
