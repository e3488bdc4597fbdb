"""Chained 64-bit block hashes, the same in every process.

A block's hash covers its whole prefix: ``state[i] = state[i-1] * M + c[i]`` (mod 2**64),
where ``c[i]`` is a mixed hash of page i's tokens, and the announced hash is
``fmix64(state[i])``. The chain is linear so a whole node is hashed with a few
vectorised passes (a cumulative sum with powers of ``M``), not a Python step per page;
the final mix makes the announced hashes well spread. Python's salted ``hash()`` is
never used.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from struct import calcsize

import numpy as np

MASK64 = (1 << 64) - 1
ROOT_STATE = 0x9E3779B97F4A7C15
MULTIPLIER = 0xD6E8FEB86659FD93  # odd, so invertible mod 2**64
_MULTIPLIER_INV = pow(MULTIPLIER, -1, 1 << 64)
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C1_INT = 0xFF51AFD7ED558CCD
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, vectorised; returns a new uint64 array."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> _S33
    x *= _C1
    x ^= x >> _S33
    x *= _C2
    x ^= x >> _S33
    return x


def fmix64_int(x: int) -> int:
    x &= MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return x


_FIELD_MULT = 0xC2B2AE3D27D4EB4F  # odd, 3 mod 4


def fold_fields(seed: int, fields: tuple[int, ...]) -> int:
    """A 64-bit digest of ``seed`` and ``fields`` (ints, any sign): a polynomial over
    them mod 2**64, then ``fmix64``.

    The multiplier is odd, so a change of any one field always changes the result;
    changes of several can cancel only when their differences meet a relation like
    ``d1 == -d2 * M**k`` mod 2**64, which no natural small differences do. One mix at the
    end, not one per field: a rank and the mirror take a digest every step, and a mix
    costs several multiply-adds (results/group_timings.md).
    """
    x = seed & MASK64
    for v in fields:
        x = (x * _FIELD_MULT + v) & MASK64
    return fmix64_int(x)


def _powers(base: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    v = 1
    for i in range(n):
        out[i] = v
        v = (v * base) & MASK64
    return out


class PageHasher:
    """Hashes whole pages of int32 tokens into chain states.

    Owns growing tables of powers of ``M`` and of its inverse; they only grow, so a
    hasher can be shared by every node of one cache.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # Per-position multipliers make a page's hash depend on token order.
        rng = np.random.Generator(np.random.PCG64(0x7C0DE))
        width = (page_size + 1) // 2 if page_size % 2 == 0 else page_size
        self._mult = rng.integers(1, 2**62, size=width, dtype=np.int64) * 2 + 1
        self._mult_ints = self._mult.tolist()  # for chain_few
        self._unpackers: dict[int, Callable[[bytes], tuple[int, ...]]] = {}  # by byte length
        self._pow = _powers(MULTIPLIER, 1)
        self._pow_inv = _powers(_MULTIPLIER_INV, 1)
        self._c1_inv = self._pow_inv * _C1  # C1 * M**-i: page_words' last multiply

    def _grow(self, n: int) -> None:
        if n + 1 > self._pow.size:
            size = max(n + 1, 2 * self._pow.size)
            self._pow = _powers(MULTIPLIER, size)
            self._pow_inv = _powers(_MULTIPLIER_INV, size)
            self._c1_inv = self._pow_inv * _C1

    def page_words(self, key: np.ndarray) -> np.ndarray:
        """One mixed uint64 per page of ``key`` (len a multiple of the page size)."""
        c = self._premix(key)
        c *= _C1
        return c

    def _premix(self, key: np.ndarray) -> np.ndarray:
        ps = self.page_size
        if ps % 2 == 0:
            # Two int32 tokens per 64-bit word halves the work; int64 matmul wraps mod 2**64
            # exactly like uint64 and is the fastest multiply-add numpy has.
            words = np.ascontiguousarray(key).view(np.int64).reshape(-1, ps // 2)
        else:
            words = key.astype(np.int64).reshape(-1, ps)
        c = (words @ self._mult).view(np.uint64)
        # One xorshift-multiply round (with page_words' C1): the chain's final fmix64
        # does the full mixing.
        c ^= c >> _S33
        return c

    def chain(self, key: np.ndarray, parent_state: int) -> np.ndarray:
        """Chain states of every page of ``key`` following ``parent_state``.

        ``state[i] = M**i * (sum_{j<=i} c[j] * M**-j + M * parent)``, in place on one
        array: seven numpy calls whatever the length.
        """
        c = self._premix(key)
        n = c.size
        self._grow(n)
        c *= self._c1_inv[:n]
        np.add.accumulate(c, out=c)  # np.cumsum's wrapper costs more than the sum here
        c += np.uint64((MULTIPLIER * parent_state) & MASK64)
        c *= self._pow[:n]
        return c

    def chain_runs(
        self, key: np.ndarray, starts: np.ndarray, sizes: np.ndarray, parents: np.ndarray
    ) -> np.ndarray:
        """``chain`` of several runs at once, equal to their chains back to back: ``key``
        holds the runs' pages back to back, run r from page ``starts[r]`` (ascending, the
        first 0), ``sizes[r]`` pages long (none empty), following chain state
        ``parents[r]`` (uint64).

        Why: a step adds a few short nodes, and ``chain`` costs its numpy calls per node.
        With one prefix sum over every page, run r's state at page g is
        ``M**g * (S[g] - S[s-1] + M**-s * M * parent)`` (s its first page): the per-run
        part is one value per run, repeated over its pages. Eleven numpy calls in all.
        """
        c = self._premix(key)
        n = c.size
        self._grow(n)
        c *= self._c1_inv[:n]
        np.add.accumulate(c, out=c)
        offset = np.zeros(starts.size, dtype=np.uint64)
        offset[1:] = c[starts[1:] - 1]
        offset -= self._pow_inv[starts] * (parents * np.uint64(MULTIPLIER))
        c -= np.repeat(offset, sizes)
        c *= self._pow[:n]
        return c

    def chain_pages(self, key: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """``chain_runs`` of runs that are one page each (a step's new one-page leaves):
        page r's state is ``M * parents[r] + C1 * c[r]``, the chain's recurrence taken once,
        so none of ``chain_runs``' prefix sums is needed. Four numpy calls beyond premix."""
        c = self._premix(key)
        c *= _C1
        c += parents * np.uint64(MULTIPLIER)
        return c

    def chain_few(self, kb: bytes, parent_state: int) -> list[int]:
        """``chain`` of a few pages in Python ints: the same states, as a list.

        Why: most nodes a step adds are a page or two, and numpy's fixed cost per call
        (results/group_timings.md) is then most of hashing them. Uses
        the chain's recurrence ``state[i] = M * state[i-1] + C1 * c[i]`` directly; the
        int64 products wrap exactly as numpy's int64 matmul does once masked.
        """
        words = self._words(kb)
        mult = self._mult_ints
        width = len(mult)
        states = []
        s = parent_state
        for i in range(0, len(words), width):
            c = sum(map(operator.mul, words[i : i + width], mult)) & MASK64
            c ^= c >> 33
            s = (MULTIPLIER * s + _C1_INT * c) & MASK64
            states.append(s)
        return states

    def _words(self, kb: bytes) -> tuple[int, ...]:
        # premix's words (int64 pairs of tokens for an even page size, else int32 tokens)
        # as Python ints, in native order as numpy views them: struct reads them in a third of
        # the time of numpy's frombuffer + tolist.
        n = len(kb)
        unpack = self._unpackers.get(n)
        if unpack is None:
            fmt = "q" if self.page_size % 2 == 0 else "i"
            unpack = self._unpackers[n] = struct.Struct(f"={n // calcsize(fmt)}{fmt}").unpack
        return unpack(kb)


def block_hashes(states: np.ndarray) -> np.ndarray:
    """The announced block hashes (uint64) of chain states."""
    return fmix64(states)
