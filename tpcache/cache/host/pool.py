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

import itertools

import numpy as np

from tpcache.cache.allocator import (
    CACHED,
    FREE,
    PageAllocator,
    log_one_group,
    ring_put,
    ring_take,
)


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

    def alloc(self, n: int, tag: int = CACHED, *, copy: bool = True) -> np.ndarray:
        counts = self._counts
        if not 0 <= n <= counts[FREE]:
            return super().alloc(n, tag, copy=copy)  # (it raises)
        head, fifo = self._head, self._fifo
        pages = ring_take(fifo, head, n)
        if copy and pages.base is fifo:
            pages = pages.copy()
        self._head = (head + n) % self.num_pages
        counts[FREE] -= n
        counts[tag] += n
        return pages

    def recycle(self, pages: np.ndarray, owner: int, n: int, tag: int) -> np.ndarray:
        """``free(pages, owner, checked=False)`` then ``alloc(n, tag)`` in one step (the
        host tier's write into a full pool): the group goes to the FIFO's tail and ``n``
        come off its head, as the two calls do. ``pages`` (int64) are the caller's to give
        up: they are sorted in place."""
        counts = self._counts
        m = pages.size
        if m < 2 or n > counts[FREE] + m or pages.dtype != np.int64:
            return super().recycle(pages, owner, n, tag)  # (it raises if n does not fit)
        pages.sort(kind="stable")
        self._free_log = log_one_group(self._free_log, int(np.add.reduce(pages)), m)
        head, fifo = self._head, self._fifo
        ring_put(fifo, (head + counts[FREE]) % self.num_pages, pages)
        taken = ring_take(fifo, head, n)
        if taken.base is fifo:
            taken = taken.copy()
        self._head = (head + n) % self.num_pages
        counts[owner] -= m
        counts[FREE] += m - n
        counts[tag] += n
        return taken

    def free_groups(self, groups: list[np.ndarray], owner: int = CACHED) -> None:
        """``free(g, owner, checked=False)`` for each of ``groups`` in order (one free group
        each): the same FIFO and free log, in fewer numpy calls. The groups are the
        caller's to give up: int64 ones are sorted in place."""
        groups = [g if g.dtype == np.int64 else g.astype(np.int64) for g in groups if g.size]
        if not groups:  # (an empty free is no group, as in ``free``)
            return
        for g in groups:
            g.sort(kind="stable")
        if len(groups) == 1:
            pages = groups[0]
            self._free_log = log_one_group(self._free_log, int(np.add.reduce(pages)), pages.size)
        else:
            sizes = [g.size for g in groups]
            pages = np.concatenate(groups)
            sums = np.add.reduceat(pages, [0, *itertools.accumulate(sizes[:-1])]).tolist()
            log = self._free_log
            for total, n in zip(sums, sizes, strict=True):
                log = log_one_group(log, total, n)
            self._free_log = log
        counts = self._counts
        ring_put(self._fifo, (self._head + counts[FREE]) % self.num_pages, pages)
        counts[owner] -= pages.size
        counts[FREE] += pages.size
