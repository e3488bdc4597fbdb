"""``LinkWriter``: the step hub's thread that writes what a local rank's socket could not
take at once (``unix_link.UnixLink``).

Why a thread: a message larger than a socket's buffer (a long prompt's step, many steps
coalesced, a batched forward) can only be written as the rank reads it, and a rank reads
between steps. Written from the coordinator's thread, the send waited for a rank busy with
a long step and held the coordinator (its mirror, its frontend) for that long. The hub's
thread still writes first, so a message that fits (most steps) never goes through here:
no thread wake-up is added to a small step's round trip.

The writer also keeps the send timeout: a link whose oldest message is not written by its
deadline is cut (``UnixLink.write``), so a rank that stopped reading can never hold a
message half-written, and the hub names it at its next call.
"""

from __future__ import annotations

import select
import threading
import time
from typing import Any


class LinkWriter:
    """Writes the links that ``want`` it, in poll order, until each has nothing left.
    Owned by one ``UnixLinks``; ``want`` and ``close`` are called from the hub's thread.
    ``_pending`` is owned under ``_wake``."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._pending: set[Any] = set()  # UnixLinks with bytes left
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tpcache-hub-writer", daemon=True)
        self._thread.start()

    def want(self, link: Any) -> None:
        """``link`` has bytes left (``UnixLink.queue`` said so): write them."""
        with self._wake:
            self._pending.add(link)
            self._wake.notify()

    def close(self) -> None:
        """Stop writing (what is left is dropped with the links) and end the thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                links = list(self._pending)
            deadlines = [d for link in links if (d := link.deadline()) is not None]
            wait_s = min(deadlines) - time.monotonic() if deadlines else 0.0
            poller = select.poll()
            for link in links:
                poller.register(link.fd, select.POLLOUT)
            # Bounded, so that a link past its deadline is cut in time.
            poller.poll(max(0, min(int(wait_s * 1000) + 1, 50)))
            now = time.monotonic()
            for link in links:
                if not link.write(now):
                    with self._wake:
                        # Empty under its lock: a message queued since then has already
                        # asked for the writer again (``want`` comes after ``queue``).
                        if link.deadline() is None:
                            self._pending.discard(link)
