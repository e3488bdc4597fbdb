"""Turning token ids from a caller into the cache's compact key arrays.

Keys are 1-D ``int32`` numpy arrays: half the memory of int64, and every model
vocabulary fits. Conversion is vectorised; nothing here loops over tokens in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from tpcache.cache.errors import InvalidSlots, InvalidTokens

MAX_TOKEN_ID = 2**31 - 1
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)

TokenLike = Any  # list[int] | np.ndarray | torch.Tensor


def _to_numpy(values: TokenLike, what: str, error: type[Exception]) -> np.ndarray:
    """``values`` as a 1-D integer numpy array (a view when it can be), or ``error``
    saying what was wrong: whatever a caller passes, the cache raises its own type."""
    if type(values) is np.ndarray:
        arr = values
    elif isinstance(values, np.ma.MaskedArray):
        raise error(f"{what} must not be a masked array (masked entries have no value)")
    # torch is optional for cache/: recognise a tensor without importing torch.
    elif type(values).__module__.startswith("torch") and hasattr(values, "detach"):
        arr = _tensor_to_numpy(values, what, error)
    else:
        try:
            arr = np.asarray(values)  # also an ndarray subclass as a plain ndarray
        except Exception as exc:  # whatever an object's __array__ or __len__ raises
            raise error(f"{what} must be a sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise error(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise error(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def _tensor_to_numpy(t, what: str, error: type[Exception]) -> np.ndarray:
    # Refused before numpy sees them: a float, bool or complex tensor (bf16 has no numpy
    # type), a sparse or meta tensor (no dense values to read).
    if t.is_floating_point() or t.is_complex() or str(t.dtype) == "torch.bool":
        raise error(f"{what} must be integers, got a tensor of {t.dtype}")
    if str(t.layout) != "torch.strided":
        raise error(f"{what} must be a dense tensor, got layout {t.layout}")
    if t.device.type == "meta":
        raise error(f"{what} must hold values, got a tensor on the meta device")
    try:
        return t.detach().cpu().numpy()
    except Exception as exc:
        raise error(f"{what}: cannot read a tensor of {t.dtype} on {t.device}: {exc}") from None


def as_tokens(
    tokens: TokenLike, *, allow_empty: bool = False, copy: bool = False, defer_sign: bool = False
) -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array.

    A copy is made only if needed, or with ``copy`` (for keys the cache keeps: a caller
    may reuse its buffer, and a torch tensor's numpy view shares its memory) unless the
    tokens' memory is an immutable ``bytes`` object (``frozen_tokens``, or tokens
    decoded from a message), which nobody can write to.
    Raises ``InvalidTokens`` for non-integers, wrong shape, negatives, ids above
    ``MAX_TOKEN_ID``, or an empty key when ``allow_empty`` is false.

    ``defer_sign``: an int32 array is not scanned for negatives here; the caller must
    call ``check_sign`` for the part it did not match against cached keys.
    """
    arr = tokens
    # The common case (a checked key, a decoded op's tokens) in one test: a plain 1-D int32
    # array with tokens, which needs none of _to_numpy's conversions.
    if not (type(arr) is np.ndarray and arr.dtype is _INT32 and arr.ndim == 1 and arr.size):
        arr = _to_numpy(tokens, "tokens", InvalidTokens)
        if arr.size == 0:
            if not allow_empty:
                raise InvalidTokens("tokens must not be empty")
            return np.zeros(0, dtype=np.int32)
        if arr.dtype != _INT32:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi > MAX_TOKEN_ID:
                raise InvalidTokens(f"token ids must be in [0, {MAX_TOKEN_ID}], got [{lo}, {hi}]")
            return arr.astype(np.int32)  # a new contiguous array
    if not defer_sign and min_value(arr) < 0:
        raise InvalidTokens(f"token ids must be >= 0, got {min_value(arr)}")
    if not arr.flags.c_contiguous or (copy and not is_frozen(arr)):
        return arr.copy()
    return arr


def is_frozen(arr: np.ndarray) -> bool:
    """Whether ``arr`` views an immutable ``bytes`` object (then no one can change it:
    numpy refuses to make such an array, or any view of it, writeable)."""
    base = arr.base
    while type(base) is np.ndarray:
        base = base.base
    return type(base) is bytes


def frozen_tokens(tokens: TokenLike) -> np.ndarray:
    """Token ids (int32) in an immutable buffer, as they are when decoded from a message:
    the cache keeps such a key without copying it (``as_tokens``). Raises
    ``InvalidTokens`` as ``as_tokens`` does."""
    return joined_key(as_tokens(tokens, allow_empty=True))


# A numpy reduction has a fixed cost whatever the length; a Python min or sum over
# tolist() is cheaper for short arrays (results/group_timings.md). Decode steps and short
# outputs are that small.
_SMALL_MIN = 32
_SMALL_SUM = 64


def min_value(arr: np.ndarray) -> int:
    """The smallest element of a non-empty integer array."""
    return min(arr.tolist()) if arr.size <= _SMALL_MIN else int(np.minimum.reduce(arr))


def int_sum(arr: np.ndarray) -> int:
    """The exact sum of an integer array (0 if empty)."""
    return sum(arr.tolist()) if arr.size <= _SMALL_SUM else int(np.add.reduce(arr))


def check_sign(key: np.ndarray, start: int) -> None:
    """The scan ``as_tokens(defer_sign=True)`` left out, of ``key[start:]`` only.

    Why only there: ``key[:start]`` compared equal to cached keys, and every cached
    token was checked when it came in, so a negative id can only be after ``start``. A
    prompt that is mostly cached (a long conversation) is then not scanned twice.
    """
    if start < key.size and min_value(key[start:]) < 0:
        raise InvalidTokens(f"token ids must be >= 0, got {min_value(key)}")


def as_slots(slots: TokenLike, count: int | None, limit: int) -> np.ndarray:
    """Validate slot ids (``count`` of them unless ``None``, in ``[0, limit)``) as int64."""
    arr = _to_numpy(slots, "slots", InvalidSlots)
    if count is not None and arr.size != count:
        raise InvalidSlots(f"got {arr.size} slot ids for {count} tokens")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise InvalidSlots(f"slot ids must be >= 0, got {lo}")
        if hi >= limit:
            raise InvalidSlots(f"slot ids out of range: must be < {limit}, got {hi}")
    return arr.astype(np.int64, copy=False)


def slots_to_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page ids of a run of slots laid out page by page (slot = page * size + offset).

    Raises ``InvalidSlots`` if the slots are not whole pages in that layout.
    """
    if slots.size % page_size:
        raise InvalidSlots(f"{slots.size} slots are not whole pages of {page_size}")
    if page_size == 1:
        return slots.astype(np.int64, copy=False)
    grid = slots.reshape(-1, page_size)
    pages = grid[:, 0] // page_size
    expect = pages[:, None] * page_size + np.arange(page_size)
    if not np.array_equal(grid, expect):
        bad = int(np.flatnonzero((grid != expect).any(axis=1))[0])
        raise InvalidSlots(
            f"slots of page {bad} are not page * {page_size} + offset: {grid[bad].tolist()}"
        )
    return pages.astype(np.int64, copy=False)


def key_bytes(key: np.ndarray) -> bytes:
    """The bytes of an int32 key: the bytes object it views whole if it is one (a key
    made by ``joined_key``), else a copy."""
    owner = key.base
    if isinstance(owner, np.ndarray):
        owner = owner.base
    if type(owner) is bytes and len(owner) == key.nbytes and key.flags.c_contiguous:
        return owner
    return key.tobytes()


def joined_key(*parts: np.ndarray) -> np.ndarray:
    """The concatenation of int32 key arrays as a read-only view of one bytes object, so
    that a tree node can keep those bytes (``key_bytes``) without a second copy."""
    return np.frombuffer(b"".join(parts), dtype=np.int32)


def join_pages(parts: Iterable[np.ndarray]) -> np.ndarray:
    """Contiguous int64 page arrays back to back, as a new writable int64 array.

    Why not ``np.concatenate``: its cost per array is several times a bytearray join of
    their buffers (results/group_timings.md). Every page array of the cache is int64 (the
    allocator's ids), which this relies on: it joins bytes, it does not convert.
    """
    return np.frombuffer(bytearray().join(parts), _INT64)


def read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr``: what a result may show of an array the cache keeps
    using (a request's row), so that a caller cannot write into the cache's state."""
    view = arr.view()
    view.setflags(write=False)  # half the cost of setting flags.writeable
    return view


def pages_to_slots(pages: np.ndarray, page_size: int, num_tokens: int | None = None) -> np.ndarray:
    """Slot ids (int64, a new array) of the tokens held in ``pages``, cut to ``num_tokens``
    if given."""
    if page_size == 1:
        slots = pages.astype(np.int64)  # a copy: never a view of the cache's own rows
    else:
        p = pages if pages.dtype == np.int64 else pages.astype(np.int64)
        slots = (p[:, None] * page_size + _offsets(page_size)).ravel()
    return slots if num_tokens is None else slots[:num_tokens]


@functools.lru_cache(maxsize=16)
def _offsets(page_size: int) -> np.ndarray:
    offsets = np.arange(page_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets
