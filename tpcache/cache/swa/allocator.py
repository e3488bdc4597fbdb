"""Paired page allocator of a hybrid (full + sliding-window) KV cache.

Two pools with the same page size: the full pool holds KV of the full-attention layers
for every cached or running token, the SWA pool KV of the sliding-window layers only
where someone can still see it. Each full page maps to at most one SWA page
(``swa_of``); a full page without one is a page whose SWA KV was dropped (a tombstone's
page in the tree).

The full pool is a ``PageAllocator`` (owner tags FREE/HELD/CACHED/LENT, a FIFO of sorted
frees). An SWA page's owner is its full page's owner, so the SWA pool keeps no tags of
its own: ``SwaPool`` is only the FIFO of its free pages, and a page is in use exactly
when a full page that is not free maps to it. That makes moving pages from a request to
the tree a full-pool-only change. A free group goes back sorted, as the full pool's
does, so the order SWA pages are handed out in depends only on which pages were freed
together, never on the order an eviction happened to visit them; the pool's log folds
each group's ids with position weights, so the digest sees that order.
``check_integrity`` catches a double free or a leaked SWA page from the mapping.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import (
    FREE,
    HELD,
    LENT,
    PageAllocator,
    log_one_group,
    ring_put,
    ring_take,
)
from tpcache.cache.errors import AllocatorError, IntegrityError, OutOfCapacity
from tpcache.cache.tree.hashing import fmix64

_MASK = (1 << 64) - 1

_EMPTY = np.zeros(0, dtype=np.int64)


class SwaPool:
    """The free SWA pages: a FIFO ring, ``0..n-1`` at start; each free appends its group
    sorted. Owned by ``PairedAllocator``; its fingerprint is the free count, the head and
    a log of the free groups that covers their ids in ring order (``_group_sum``)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._fifo = np.empty(num_pages, dtype=np.int64)
        # Odd pseudo-random int64 weight per position in a group: a group's log term is
        # sum(page * weight), which changes when any page or its place in the ring does
        # (one dot product, where a mix per page would cost 4x).
        w = fmix64(np.arange(1, num_pages + 1, dtype=np.uint64)) | np.uint64(1)
        self._weights = w.view(np.int64)
        self._w0 = int(self._weights[0])
        self.reset()

    def reset(self) -> None:
        self._fifo[:] = np.arange(self.num_pages, dtype=np.int64)
        self._head = 0
        self.num_free = self.num_pages
        self._free_log = 0

    def take(self, n: int) -> np.ndarray:
        """The first ``n`` free pages; a view of the ring when it can be (valid until the
        next ``give``): callers store it at once. Raises ``OutOfCapacity``, taking nothing."""
        if n > self.num_free:
            raise OutOfCapacity(f"asked for {n} SWA pages, {self.num_free} free")
        pages = ring_take(self._fifo, self._head, n)
        self._head = (self._head + n) % self.num_pages
        self.num_free -= n
        return pages

    def give(self, pages: np.ndarray) -> None:
        """Append ``pages`` (in use until now; the caller checked) to the ring, sorted."""
        n = pages.size
        if n == 0:
            return
        if n > 1:
            pages = np.sort(pages, kind="stable")  # a few ascending runs, most often
        ring_put(self._fifo, (self._head + self.num_free) % self.num_pages, pages)
        self.num_free += n
        self._free_log = log_one_group(self._free_log, self._group_sum(pages), n)

    def give_one(self, page: int) -> None:
        """``give`` of one page, with Python ints."""
        self._fifo[(self._head + self.num_free) % self.num_pages] = page
        self.num_free += 1
        self._free_log = log_one_group(self._free_log, (page * self._w0) & _MASK, 1)

    def _group_sum(self, pages: np.ndarray) -> int:
        # int64 products and sum wrap mod 2**64, as the log does.
        return int(pages @ self._weights[: pages.size]) & _MASK

    def free_pages(self) -> np.ndarray:
        """The free pages in FIFO order (a copy)."""
        return self._fifo[(self._head + np.arange(self.num_free)) % self.num_pages]

    def fingerprint(self) -> tuple[int, ...]:
        return (self.num_free, self._head, self._free_log)


class PairedAllocator:
    """A full pool and an SWA pool plus the full-page -> SWA-page mapping.

    ``full`` and ``swa`` are owned by this class (read them, change them only through
    its methods); ``_swa_of[p]`` is the SWA page of full page ``p`` or -1 (internal only:
    callers get arrays of real ids or a typed error). Every method validates its whole
    input before it changes anything, unless called with ``checked=False`` by a caller
    that validated it already.

    It answers what a tree and a cache ask of a ``PageAllocator`` (owner tags, counts,
    checks: the full pool's, which every page has), so one tree and one request
    lifecycle serve both; per-pool figures come as tuples (full, SWA).
    """

    def __init__(self, num_pages: int, num_swa_pages: int, page_size: int) -> None:
        if not 1 <= num_swa_pages <= num_pages:
            raise AllocatorError(
                f"the SWA pool ({num_swa_pages} pages) must have 1 to {num_pages} pages"
                " (the full pool's)"
            )
        self.page_size = page_size
        self.full = PageAllocator(num_pages, page_size)
        self.swa = SwaPool(num_swa_pages)
        self._swa_of = np.full(num_pages, -1, dtype=np.int64)

    # ---- queries --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a paired allocation can take now: the smaller free count of the pools."""
        return min(self.full.num_free, self.swa.num_free)

    @property
    def num_pages(self) -> int:
        """Full pages (every page id is one)."""
        return self.full.num_pages

    def pool_pages(self) -> tuple[int, int]:
        return self.full.num_pages, self.swa.num_pages

    def pool_free(self) -> tuple[int, int]:
        return self.full.num_free, self.swa.num_free

    def shortfall(self, n: int) -> tuple[int, int]:
        full, swa = self.full.num_free, self.swa.num_free
        return (n - full if n > full else 0), (n - swa if n > swa else 0)

    def count(self, tag: int) -> int:
        """Full pages tagged ``tag`` (an SWA page's owner is its full page's)."""
        return self.full.count(tag)

    def tags_of(self, pages: np.ndarray) -> np.ndarray:
        return self.full.tags_of(pages)

    def check_owned(self, pages: np.ndarray, owner: int) -> None:
        """Raise ``AllocatorError`` unless full ``pages`` are distinct, in range and ``owner``'s."""
        self.full.check_owned(pages, owner)

    def swa_of(self, pages: np.ndarray, *, checked: bool = True) -> np.ndarray:
        """The SWA pages of full ``pages``; raises ``AllocatorError`` if one has none
        (unless ``checked=False``: a caller that knows they all have one)."""
        swa = self._swa_of[pages]
        if checked and swa.size and np.minimum.reduce(swa) < 0:
            bad = int(pages[int(np.argmin(swa))])
            raise AllocatorError(f"full page {bad} has no SWA page")
        return swa

    def has_swa(self, pages: np.ndarray) -> np.ndarray:
        """Bool per full page: does it still have an SWA page."""
        return self._swa_of[pages] >= 0

    # ---- changes --------------------------------------------------------------------
    def reset(self) -> None:
        self.full.reset()
        self.swa.reset()
        self._swa_of[:] = -1

    def alloc(self, n: int, tag: int = HELD, *, copy: bool = True) -> np.ndarray:
        """``n`` full pages (int64) tagged ``tag``, each paired with a fresh SWA page.

        ``copy=False`` as in ``PageAllocator.alloc`` (a view valid until the next free).
        Raises ``OutOfCapacity`` (taking nothing) if either pool has fewer than ``n`` free.
        """
        return self.alloc_pair(n, tag, copy=copy)[0]

    def alloc_pair(
        self, n: int, tag: int = HELD, *, copy: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """As ``alloc``, and the SWA pages paired with them (a view unless ``copy``)."""
        if n > self.swa.num_free and n <= self.full.num_free:
            raise OutOfCapacity(
                f"asked for {n} pages: {self.full.num_free} full and {self.swa.num_free} SWA free"
            )
        pages = self.full.alloc(n, tag, copy=copy)  # raises for n < 0 or too few full pages
        swa = self.swa.take(n)
        self._swa_of[pages] = swa
        return pages, (swa.copy() if copy else swa)

    def free(self, pages: np.ndarray, owner: int = HELD, *, checked: bool = True) -> None:
        """Free full ``pages`` (tagged ``owner``) and the SWA pages they still have."""
        if checked:
            self.full.check_owned(pages, owner)
        if pages.size == 0:
            return
        if pages.size == 1:  # a request's partial last page, most often
            page = int(pages[0])
            swa_page = int(self._swa_of[page])
            self._swa_of[page] = -1
            self.full.free(pages, owner, checked=False)
            if swa_page >= 0:
                self.swa.give_one(swa_page)
            return
        swa = self._swa_of[pages]
        self._swa_of[pages] = -1
        self.full.free(pages, owner, checked=False)
        self.swa.give(swa if np.minimum.reduce(swa) >= 0 else swa[swa >= 0])

    def free_swa(self, pages: np.ndarray, owner: int, *, checked: bool = True) -> None:
        """Free only the SWA pages of full ``pages``; the full pages stay ``owner``'s.

        Raises ``AllocatorError`` if a full page is not ``owner``'s or has no SWA page.
        """
        self.release(_EMPTY, pages, owner, checked=checked)

    def release(
        self, pages: np.ndarray, swa_only: np.ndarray, owner: int, *, checked: bool = True
    ) -> None:
        """Free ``pages`` whole and the SWA part of ``swa_only``: one free group per pool."""
        if not swa_only.size:
            self.free(pages, owner, checked=checked)
            return
        if checked:
            self.full.check_owned(np.concatenate((pages, swa_only)), owner)
            self.swa_of(swa_only)
        swa = np.concatenate((self._swa_of[pages], self._swa_of[swa_only]))
        self._swa_of[pages] = -1
        self._swa_of[swa_only] = -1
        self.full.free(pages, owner, checked=False)
        self.swa.give(swa[swa >= 0])

    def retag(self, pages: np.ndarray, old: int, new: int, *, checked: bool = True) -> None:
        """Move full ``pages`` from owner ``old`` to ``new`` (their SWA pages follow)."""
        self.full.retag(pages, old, new, checked=checked)

    def move_swa(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Give each ``dst[i]`` (a full page without SWA) the SWA page of ``src[i]``.

        Used when a newcomer revives a tombstone: its SWA KV moves onto the cached full
        pages and its own full pages become duplicates.
        """
        if src.size != dst.size:
            raise AllocatorError(f"move_swa needs equal lengths, got {src.size} and {dst.size}")
        swa = self.swa_of(src)
        if self.has_swa(dst).any():
            raise AllocatorError("move_swa: a destination page still has an SWA page")
        if (self.full.tags_of(dst) == FREE).any():
            raise AllocatorError("move_swa: a destination page is free")
        self._swa_of[src] = -1
        self._swa_of[dst] = swa

    # ---- checks ---------------------------------------------------------------------
    def fingerprint(self) -> tuple[int, ...]:
        return (*self.full.fingerprint(), *self.swa.fingerprint())

    def swa_count(self, tag: int) -> int:
        """SWA pages whose full page is tagged ``tag`` (a full scan: for checks)."""
        return int(((self._swa_of >= 0) & self.full.tagged(tag)).sum())

    def check_integrity(self) -> None:
        """The full pool, and: the SWA pages in use are exactly those mapped from full
        pages, each from one that is not free; free and in-use SWA pages add up to the
        pool; every page a request holds or a caller was lent has its SWA page. Raises
        ``IntegrityError``."""
        self.full.check_integrity()
        mapped = np.flatnonzero(self._swa_of >= 0)
        swa = self._swa_of[mapped]
        if np.unique(swa).size != swa.size:
            raise IntegrityError("an SWA page is mapped from two full pages")
        if swa.size and int(swa.max()) >= self.swa.num_pages:
            raise IntegrityError(f"SWA page id {int(swa.max())} is out of range")
        full_tags = self.full.tags_of(mapped)
        if (full_tags == FREE).any():
            p = int(mapped[int(np.argmax(full_tags == FREE))])
            raise IntegrityError(f"free full page {p} still maps to an SWA page")
        free = self.swa.free_pages()
        if np.unique(free).size != free.size:
            raise IntegrityError("an SWA page is twice in the free FIFO (a double free)")
        if np.intersect1d(free, swa).size:
            raise IntegrityError("an SWA page is both free and mapped from a full page")
        if free.size + swa.size != self.swa.num_pages:
            raise IntegrityError(
                f"{free.size} SWA pages are free and {swa.size} mapped from full pages, of"
                f" {self.swa.num_pages} (a leaked or lost SWA page)"
            )
        for tag, name in ((HELD, "held"), (LENT, "lent")):
            if self.swa_count(tag) != self.full.count(tag):
                raise IntegrityError(
                    f"{self.full.count(tag)} full pages are {name} but {self.swa_count(tag)} of"
                    " them have SWA pages"
                )
