"""Paired page allocator of a hybrid (full + sliding-window) KV cache.

Two pools with the same page size: the full pool holds KV of the full-attention layers
for every cached or running token, the SWA pool KV of the sliding-window layers only
where someone can still see it. Each full page maps to at most one SWA page
(``swa_of``); a full page without one is a page whose SWA KV was dropped (a tombstone's
page in the tree).

Order and determinism come from the two ``PageAllocator`` FIFOs: ``alloc(n)`` takes the
first ``n`` free pages of each pool and pairs them in order; every free appends its
pages sorted. Owners: the full pool keeps the owner tags (FREE/HELD/CACHED/LENT); an SWA
page's owner is its full page's owner (the mapping says which), so the SWA pool tags
its pages only free or in use (``IN_USE``). That halves the work of moving pages from a
request to the tree, and a double free or a leaked SWA page is still caught: every SWA
page in use is mapped from exactly one full page that is not free.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.allocator import FREE, HELD, PageAllocator
from tpcache.cache.errors import AllocatorError, IntegrityError, OutOfCapacity

_EMPTY = np.zeros(0, dtype=np.int64)
IN_USE = HELD  # the SWA pool's tag of a page that is not free


class PairedAllocator:
    """A full pool and an SWA pool plus the full-page -> SWA-page mapping.

    ``full`` and ``swa`` are owned by this class (read them, change them only through
    its methods); ``_swa_of[p]`` is the SWA page of full page ``p`` or -1 (internal only:
    callers get arrays of real ids or a typed error). Every method validates its whole
    input before it changes anything, unless called with ``checked=False`` by a caller
    that validated it already.
    """

    def __init__(self, num_pages: int, num_swa_pages: int, page_size: int) -> None:
        if num_swa_pages > num_pages:
            raise AllocatorError(
                f"the SWA pool ({num_swa_pages} pages) may not exceed the full pool ({num_pages})"
            )
        self.page_size = page_size
        self.full = PageAllocator(num_pages, page_size)
        self.swa = PageAllocator(num_swa_pages, page_size)
        self._swa_of = np.full(num_pages, -1, dtype=np.int64)

    # ---- queries --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a paired allocation can take now: the smaller free count of the pools."""
        return min(self.full.num_free, self.swa.num_free)

    def swa_of(self, pages: np.ndarray) -> np.ndarray:
        """The SWA pages of full ``pages``; raises ``AllocatorError`` if one has none."""
        swa = self._swa_of[pages]
        if swa.size and int(swa.min()) < 0:
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
        if n > self.swa.num_free and n <= self.full.num_free:
            raise OutOfCapacity(
                f"asked for {n} pages: {self.full.num_free} full and {self.swa.num_free} SWA free"
            )
        pages = self.full.alloc(n, tag, copy=copy)  # raises for n < 0 or too few full pages
        self._swa_of[pages] = self.swa.alloc(n, IN_USE, copy=False)
        return pages

    def free(self, pages: np.ndarray, owner: int = HELD, *, checked: bool = True) -> None:
        """Free full ``pages`` (tagged ``owner``) and the SWA pages they still have."""
        if checked:
            self.full.check_owned(pages, owner)
        if pages.size == 0:
            return
        swa = self._swa_of[pages]
        self._swa_of[pages] = -1
        self.full.free(pages, owner, checked=False)
        self.swa.free(swa[swa >= 0], IN_USE, checked=False)

    def free_swa(self, pages: np.ndarray, owner: int, *, checked: bool = True) -> None:
        """Free only the SWA pages of full ``pages``; the full pages stay ``owner``'s.

        Raises ``AllocatorError`` if a full page is not ``owner``'s or has no SWA page.
        """
        self.release(_EMPTY, pages, owner, checked=checked)

    def release(
        self, pages: np.ndarray, swa_only: np.ndarray, owner: int, *, checked: bool = True
    ) -> None:
        """Free ``pages`` whole and the SWA part of ``swa_only``, as one free group per pool."""
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
        self.swa.free(swa[swa >= 0], IN_USE, checked=False)

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
        return int(((self._swa_of >= 0) & (self.full._tags == tag)).sum())

    def check_integrity(self) -> None:
        """Both pools, and: each SWA page in use is mapped from exactly one full page that
        is not free, and no other SWA page is in use. Raises ``IntegrityError``."""
        self.full.check_integrity()
        self.swa.check_integrity()
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
        if (self.swa.tags_of(swa) != IN_USE).any():
            raise IntegrityError("an SWA page mapped from a full page is free in the SWA pool")
        in_use = self.swa.count(IN_USE)
        if in_use != swa.size or self.swa.num_free + in_use != self.swa.num_pages:
            raise IntegrityError(
                f"{in_use} SWA pages are in use but {swa.size} are mapped from full pages"
                " (a leaked or lost SWA page)"
            )
