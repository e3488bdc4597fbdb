"""Page-granular KV slot allocator with a defined allocation order.

Slot ``s`` lives in page ``s // page_size`` at offset ``s % page_size``. Every page has
one owner tag: FREE, HELD (by a running request's row), CACHED (by the radix tree) or
LENT (to a caller of ``RadixCache.alloc_slots``), so a free of a page that the caller
does not own is caught, not silently accepted.

Order: free pages form a FIFO. At start it is ``0, 1, ..., n-1``; each free appends its
pages sorted. ``alloc(k)`` takes the first ``k``. So the same op sequence hands out the
same page ids in every process, and an allocation or a free costs O(k) vectorised
work, not a Python step per page. Page ids are int64 (numpy's index type): indexing the
tag array with int32 ids would convert them on every call.
"""

from __future__ import annotations

import numpy as np

from tpcache.cache.errors import AllocatorError, IntegrityError, OutOfCapacity

FREE, HELD, CACHED, LENT = 0, 1, 2, 3
TAG_NAMES = ("free", "held", "cached", "lent")
NUM_TAGS = len(TAG_NAMES)


_MASK = (1 << 64) - 1
_INT64 = np.dtype(np.int64)
_MIX = 0xD6E8FEB86659FD93  # odd


def log_free(log: int, pages: np.ndarray) -> int:
    """Fold one free group (its size and id sum) into a running 64-bit log.

    With the counts and the FIFO head, the log fingerprints the free FIFO: allocation
    takes from its head, so two allocators that freed the same groups in the same order
    hand out the same pages, and a group freed differently changes the log at once.
    Cheaper than id sums per owner kept on every move (the tree's digest covers which
    pages are cached; the allocation order covers which a request holds).
    """
    return log_one_group(log, int(np.add.reduce(pages)), pages.size)


def ring_take(ring: np.ndarray, head: int, n: int) -> np.ndarray:
    """The ``n`` entries of a FIFO ring from ``head``: a view of the ring when they do not
    wrap (valid until the ring is written again), else a new array."""
    end = head + n
    if end <= ring.size:
        return ring[head:end]
    return np.concatenate((ring[head:], ring[: end - ring.size]))


def ring_put(ring: np.ndarray, tail: int, values: np.ndarray) -> None:
    """Write ``values`` into a FIFO ring from ``tail`` on, wrapping at its end."""
    n, cap = values.size, ring.size
    if tail + n <= cap:
        ring[tail : tail + n] = values
    else:
        k = cap - tail
        ring[tail:] = values[:k]
        ring[: n - k] = values[k:]


def log_one_group(log: int, id_sum: int, n: int) -> int:
    """``log_free`` of a group given by its id sum and size."""
    return (log * _MIX + id_sum + (n << 40)) & _MASK


class PageAllocator:
    """Owns the page ownership tags and the FIFO of free pages of one KV pool.

    Fields are owned by this class alone; callers change them only through methods.
    Every method validates its whole input before it changes anything.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise AllocatorError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        try:
            # One tag byte per page, in a bytearray that ``_tags`` views: numpy for a group
            # of pages, the bytearray for the one page most calls move (a tenth of the cost).
            self._tag_bytes = bytearray(num_pages)
            self._tags = np.frombuffer(self._tag_bytes, dtype=np.int8)
            self._fifo = np.empty(num_pages, dtype=np.int64)  # ring buffer of free pages
        except (MemoryError, ValueError, OverflowError):
            # The index alone is 9 bytes a page: a capacity that cannot fit here is the
            # caller's mistake (a typo'd --capacity), not a crash.
            raise AllocatorError(
                f"a pool of {num_pages} pages (page size {page_size}) does not fit in this"
                f" machine's memory: its index alone needs {9 * num_pages / 2**30:.1f} GiB"
            ) from None
        self._counts = [0] * NUM_TAGS
        self._free_log = 0  # see log_free
        self.reset()

    # ---- queries --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._counts[FREE]

    def count(self, tag: int) -> int:
        return self._counts[tag]

    def tags_of(self, pages: np.ndarray) -> np.ndarray:
        return self._tags[pages]

    def tagged(self, tag: int) -> np.ndarray:
        """A bool per page: is it tagged ``tag``? (a full scan: for checks)."""
        return self._tags == tag

    def pool_pages(self) -> tuple[int, ...]:
        """Pages per pool (one pool here)."""
        return (self.num_pages,)

    def pool_free(self) -> tuple[int, ...]:
        """Free pages per pool (one pool here)."""
        return (self._counts[FREE],)

    def shortfall(self, n: int) -> tuple[int, ...]:
        """Pages per pool that ``n`` more would need beyond the free ones (0 if they fit)."""
        free = self._counts[FREE]
        return (n - free if n > free else 0,)

    def free_order(self) -> list[int]:
        """The free pages in the order they will be handed out (a copy; for checks)."""
        n = self._counts[FREE]
        return self._fifo[(self._head + np.arange(n)) % self.num_pages].tolist()

    def fingerprint(self) -> tuple[int, ...]:
        """Counts of the pages of each owner, the FIFO's head and the log of free groups."""
        return (*self._counts, self._head, self._free_log)

    # ---- changes --------------------------------------------------------------------
    def reset(self) -> None:
        """Every page free, FIFO back to ``0..n-1``."""
        self._tags[:] = FREE
        self._fifo[:] = np.arange(self.num_pages, dtype=np.int64)
        self._head = 0
        self._counts = [self.num_pages] + [0] * (NUM_TAGS - 1)
        self._free_log = 0

    def alloc(self, n: int, tag: int = HELD, *, copy: bool = True) -> np.ndarray:
        """Take the first ``n`` free pages (int64), tagged ``tag``.

        ``copy=False`` may return a view of the FIFO, valid only until the next free: for
        internal callers that copy the pages at once (into a request's row).
        Raises ``OutOfCapacity`` if fewer than ``n`` are free; nothing is taken then.
        """
        if n < 0:
            raise AllocatorError(f"cannot allocate {n} pages")
        if n > self._counts[FREE]:
            raise OutOfCapacity(f"asked for {n} pages, {self._counts[FREE]} free")
        head = self._head
        if head + n <= self.num_pages:  # ring_take's view, without its call
            pages = self._fifo[head : head + n]
            if copy:
                pages = pages.copy()
        else:
            pages = ring_take(self._fifo, head, n)  # a new array
        self._head = (head + n) % self.num_pages
        self._set(pages, FREE, tag)
        return pages

    def free(self, pages: np.ndarray, owner: int = HELD, *, checked: bool = True) -> None:
        """Return ``pages`` (tagged ``owner``) to the end of the FIFO, sorted.

        One call is one free group (e.g. everything one eviction released). Raises
        ``AllocatorError`` for ids out of range, repeated ids, or pages not tagged
        ``owner`` (a double free or a free of a page someone else owns). Internal callers
        that validated the pages already pass ``checked=False``.
        """
        if pages.size == 0:
            return
        if pages.dtype is not _INT64 and pages.dtype != _INT64:  # "is": the common case, fast
            pages = pages.astype(np.int64)
        if pages.size == 1 and not checked:
            self._free_one(int(pages[0]), owner)
            return
        if pages.size > 1:
            # A free group is often a few ascending runs (pages allocated together):
            # timsort ("stable") sorts those in about linear time, quicksort does not.
            pages = np.sort(pages, kind="stable")
        if checked:
            self.check_owned(pages, owner, is_sorted=True)
        ring_put(self._fifo, (self._head + self._counts[FREE]) % self.num_pages, pages)
        self._set(pages, owner, FREE)
        self._free_log = log_free(self._free_log, pages)

    def recycle(self, pages: np.ndarray, owner: int, n: int, tag: int) -> np.ndarray:
        """``free(pages, owner, checked=False)`` then ``alloc(n, tag)``, in one: the same
        pages handed out, the same FIFO and fingerprint after, fewer steps when nothing
        else is free (a full pool that drops some pages to take others: the host tier).
        Raises ``OutOfCapacity`` as ``alloc`` does (the pages are freed then)."""
        counts = self._counts
        if counts[FREE] or pages.size <= max(n, 1):
            self.free(pages, owner, checked=False)
            return self.alloc(n, tag)
        if pages.dtype is not _INT64 and pages.dtype != _INT64:
            pages = pages.astype(np.int64)
        pages = np.sort(pages, kind="stable")
        self._free_log = log_free(self._free_log, pages)
        # The FIFO is empty: the group goes in at the head and its first n come out again.
        take, rest = pages[:n], pages[n:]
        self._head = (self._head + n) % self.num_pages
        ring_put(self._fifo, self._head, rest)
        self._set(rest, owner, FREE)
        if tag != owner:
            self._set(take, owner, tag)
        return take

    def _free_one(self, page: int, owner: int) -> None:
        # A request's partial last page, most often: Python ints, no numpy call.
        counts = self._counts
        self._fifo[(self._head + counts[FREE]) % self.num_pages] = page
        self._tag_bytes[page] = FREE
        counts[owner] -= 1
        counts[FREE] += 1
        self._free_log = (self._free_log * _MIX + page + (1 << 40)) & _MASK  # log_one_group

    def retag(self, pages: np.ndarray, old: int, new: int, *, checked: bool = True) -> None:
        """Move ``pages`` from owner ``old`` to owner ``new`` (e.g. request -> tree)."""
        if pages.size == 0:
            return
        if new == FREE or old == FREE:
            raise AllocatorError("use alloc/free to move pages in or out of the free list")
        if checked:
            self.check_owned(pages, old)
        self._set(pages, old, new)

    # ---- internals ------------------------------------------------------------------
    def check_owned(self, pages: np.ndarray, owner: int, *, is_sorted: bool = False) -> None:
        """Raise ``AllocatorError`` unless ``pages`` are distinct, in range and all ``owner``'s."""
        if pages.size == 0:
            return
        sorted_pages = pages if is_sorted else np.sort(pages)
        lo, hi = int(sorted_pages[0]), int(sorted_pages[-1])
        if lo < 0 or hi >= self.num_pages:
            raise AllocatorError(f"page ids must be in [0, {self.num_pages}), got [{lo}, {hi}]")
        if sorted_pages.size > 1 and (sorted_pages[1:] == sorted_pages[:-1]).any():
            dup = np.flatnonzero(sorted_pages[1:] == sorted_pages[:-1])
            raise AllocatorError(f"page {int(sorted_pages[dup[0]])} given twice")
        tags = self._tags[sorted_pages]
        if (tags != owner).any():
            bad = np.flatnonzero(tags != owner)
            p = int(sorted_pages[bad[0]])
            raise AllocatorError(
                f"page {p} is {TAG_NAMES[int(tags[bad[0]])]}, expected {TAG_NAMES[owner]}"
                f" ({bad.size} of {sorted_pages.size} pages wrong)"
            )

    def _set(self, pages: np.ndarray, old: int, new: int) -> None:
        n = pages.size
        if n == 1:  # a request's partial last page, often: no numpy call
            self._tag_bytes[int(pages[0])] = new
        else:
            self._tags[pages] = new
        counts = self._counts
        counts[old] -= n
        counts[new] += n

    def check_integrity(self) -> None:
        """Recount everything from scratch; raise ``IntegrityError`` with the numbers."""
        counts = np.bincount(self._tags, minlength=NUM_TAGS).tolist()
        if counts != self._counts:
            raise IntegrityError(f"allocator tag counts {counts} != counters {self._counts}")
        n = self._counts[FREE]
        idx = (self._head + np.arange(n)) % self.num_pages
        queued = self._fifo[idx]
        if np.unique(queued).size != n:
            raise IntegrityError(
                f"free FIFO holds {n} entries but only {np.unique(queued).size} distinct"
            )
        not_free = np.flatnonzero(self._tags[queued] != FREE)
        if not_free.size:
            raise IntegrityError(
                f"page {int(queued[not_free[0]])} is in the free FIFO but not free"
            )
