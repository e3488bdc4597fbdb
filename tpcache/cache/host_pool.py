"""``HostPool``: the host tier's page allocator. ``PageAllocator``'s free FIFO, counts
and free log exactly (so its pages, fingerprint and the tree's digest are the same),
without a per-page owner tag kept on every move.

Why no tags: a host page is only ever free or the tree's (CACHED), so its tag is
whether it is in the free FIFO. Keeping a tag array up to date cost a scattered write
per page on every write-back, host eviction and load (the host pool is 10x the device
one, so the writes miss the cache); the tags are derived from the FIFO instead, when
something reads them (``tags_of``, ``check_owned``, ``check_integrity``: checks, never
the hot path). A checked free still refuses a page that is free already, so a double
free is caught as in the base allocator.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import CACHED, FREE, PageAllocator, log_one_group, ring_put


class HostPool(PageAllocator):
    """A ``PageAllocator`` whose pages are FREE or CACHED only; tags derived on reads.
    Owned as ``PageAllocator``; ``_tags`` is scratch, rewritten by ``_sync_tags``."""

    def _set(self, pages: np.ndarray, old: int, new: int) -> None:
        counts = self._counts
        n = pages.size
        counts[old] -= n
        counts[new] += n

    def _sync_tags(self) -> None:
        """Rewrite ``_tags`` from the FIFO: its pages FREE, every other CACHED."""
        tags = self._tags
        tags[:] = CACHED
        n = self._counts[FREE]
        tags[self._fifo[(self._head + np.arange(n)) % self.num_pages]] = FREE

    def tags_of(self, pages: np.ndarray) -> np.ndarray:
        self._sync_tags()
        return self._tags[pages]

    def check_owned(self, pages: np.ndarray, owner: int, *, is_sorted: bool = False) -> None:
        self._sync_tags()
        super().check_owned(pages, owner, is_sorted=is_sorted)

    def check_integrity(self) -> None:
        self._sync_tags()  # a page queued twice leaves the FREE count short: caught below
        super().check_integrity()

    def free_groups(self, groups: list[np.ndarray], owner: int = CACHED) -> None:
        """``free(g, owner, checked=False)`` for each of ``groups`` in order (one free group
        each): the same FIFO and free log, in fewer numpy calls."""
        groups = [g for g in groups if g.size]  # an empty free is no group (``free``)
        if len(groups) <= 1:
            if groups:
                self.free(groups[0], owner, checked=False)
            return
        sizes = [g.size for g in groups]
        pages = np.concatenate([np.sort(g, kind="stable") for g in groups])
        if pages.dtype != np.int64:
            pages = pages.astype(np.int64)
        starts = np.cumsum([0, *sizes[:-1]])
        sums = np.add.reduceat(pages, starts).tolist()
        log = self._free_log
        for s, n in zip(sums, sizes, strict=True):
            log = log_one_group(log, s, n)
        self._free_log = log
        ring_put(self._fifo, (self._head + self._counts[FREE]) % self.num_pages, pages)
        self._set(pages, owner, FREE)
