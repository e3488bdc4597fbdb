"""The handles a cache gives out for matched prefixes, and the locks they hold.

A handle names a node (and, with a window, the boundary mark where its SWA lock stops),
the cache generation that made it, and a tag that proves this generation made it for
that node and mark. Node ids and the owner are shown by every handle, so they cannot be
what authenticates one: the tag is a keyed hash under a random key that never leaves
this object. Another cache's handle, one from before a reset, one built by hand, or one
with a copied owner and another node's id is refused; so is a handle naming a namespace
anchor, which only the cache itself locks. ``lock()`` calls are counted per handle, so a
handle's unlock can never take a lock a running request holds on the same node.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Any

from tpcache.cache.errors import IntegrityError, LockError, UnknownHandle
from tpcache.cache.namespace import is_anchor
from tpcache.cache.records import Handle, new_owner
from tpcache.cache.swa.config import SwaHandle

_KEY_BYTES = 32  # 256 bits: past any guessing (blake2b takes up to 64 bytes)
_TAG_BYTES = 16
_PACK = struct.Struct("<qq").pack  # (node id, mark): what a tag vouches for


def _keyed(key: bytes) -> Any:
    """blake2b keyed once with ``key``; each tag copies it instead of keying again."""
    return hashlib.blake2b(key=key, digest_size=_TAG_BYTES, person=b"tpcache-hdl")


class HandleLocks:
    """One cache generation's handles and their locks. Owned by the cache, which makes a
    new one at every reset (a new ``owner`` and key: older handles name nothing).

    The key is drawn from the OS's random source, so it differs between processes and
    runs; it only signs handles, which stay in their process, and decides nothing the
    ranks compare (digests, slot ids, events and eviction order never see it).

    ``locks``: (node id, boundary mark) -> ``lock()`` calls not yet undone.
    """

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.owner = new_owner()
        self.windowed = tree.window is not None  # then handles carry the boundary mark
        self.locks: dict[tuple[int, int], int] = {}
        self._key = secrets.token_bytes(_KEY_BYTES)
        self._mac = _keyed(self._key)

    # A copy of the cache (pickle, deepcopy) is the same generation: it keeps the key.
    # The keyed state itself does not pickle, so it is made again from the key.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_mac"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mac = _keyed(self._key)

    def _tag(self, node_id: int, mark: int) -> bytes:
        mac = self._mac.copy()
        mac.update(_PACK(node_id, mark))
        return mac.digest()

    def make(self, node: Any) -> Handle:
        """A handle to ``node`` (with a window: and the boundary of its last window, which
        may give a node its mark)."""
        # A match starts below an anchor and ends at the root for an empty one, so it
        # never ends at an anchor; a handle to one would let a caller lock it.
        assert not is_anchor(node), f"a handle to anchor {node.id}"
        if not self.windowed:
            return Handle(node.id, self.owner, tag=self._tag(node.id, 0))
        tree = self.tree
        mark = tree.mark_of(tree.boundary(node))
        return SwaHandle(node.id, self.owner, mark, tag=self._tag(node.id, mark))

    def resolve(self, handle: Handle) -> tuple[Any, Any, int]:
        """(node, window top, mark) of a handle this generation gave out. Changes nothing.
        Raises ``UnknownHandle`` (not this cache's, forged, naming an anchor, or its node
        is gone) or ``StaleBoundary`` (its mark is not on its path)."""
        if (
            type(handle) is not (SwaHandle if self.windowed else Handle)
            or type(handle.node_id) is not int
            or (isinstance(handle, SwaHandle) and type(handle.swa_boundary) is not int)
            or type(handle.tag) is not bytes
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
        if is_anchor(node):
            raise UnknownHandle(
                f"handle {node.id} names a namespace anchor, which no handle may lock"
            )
        # Past the check above, a handle is a SwaHandle exactly when the cache is windowed.
        mark = handle.swa_boundary if isinstance(handle, SwaHandle) else 0
        # The mark is looked up before the tag is checked: one that is not on the path
        # is stale whoever made the handle, and saying so is the more useful refusal.
        top = self.tree.find_top(node, mark)
        if not hmac.compare_digest(handle.tag, self._tag(node.id, mark)):
            what = f"node {node.id}" + (f" and boundary mark {mark}" if self.windowed else "")
            raise UnknownHandle(f"handle was not given out by this cache for {what}")
        return node, top, mark

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
