"""``CallLock``: the one lock every caller of a coordinator holds, from any thread.

A coordinator is called from several threads at once when it is served: the Ray
service's calls and its health check, the network frontend's thread, a Prometheus
scrape. The cache it mirrors is not thread-safe (even reading a digest hashes new nodes
lazily), so every entry point holds this lock.

Reentrant, so a ``batch()`` block holds it around the calls inside it. ``released()``
lets go of it entirely for a long wait that must not hold other callers (a recovery
rebuilding the ranks), and takes it back at the same depth afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tpcache.errors import TpcacheError


class LockMisuse(TpcacheError, RuntimeError):
    """The lock was released by a thread that does not hold it (a bug of the caller)."""


class CallLock:
    """A reentrant lock that its holder can release for a while (``released``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread ident of the holder; written under _lock
        self._depth = 0  # how many times the holder took it

    def acquire(self, timeout: float = -1) -> bool:
        """Take the lock (again, if this thread holds it); False if ``timeout`` passed."""
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if not self._lock.acquire(timeout=timeout):
            return False
        self._owner = me
        self._depth = 1
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise LockMisuse("CallLock released by a thread that does not hold it")
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> CallLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let go of the lock (at any depth) inside the block, then take it back at the
        same depth. Other callers run meanwhile: the holder must leave the state they
        see consistent first. A thread that does not hold it runs the block as it is."""
        if not self.held():
            yield
            return
        depth, self._depth, self._owner = self._depth, 0, None
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._owner = threading.get_ident()
            self._depth = depth


__all__ = ["CallLock"]
