"""The op log's records of one cache call: the op the coordinator's mirror logs for every
rank to repeat (``logged_admit``, ``logged_extend``, ``logged_finish``), and the
``OpResult`` every rank must report for it (``admit_result``, ``evict_result``). No
collective here: how a rank applies an op and agrees on it is ``lockstep.py``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpcache.cache.keys import TokenLike, as_tokens, int_sum, key_bytes
from tpcache.cache.namespace import CacheNamespace, as_namespace
from tpcache.cache.records import RequestId
from tpcache.cache.reqtable import check_request_id
from tpcache.lockstep.ops import (
    OP_TOKENS,
    Admit,
    Extend,
    Finish,
    OpNamespace,
    OpResult,
    pack_tokens,
)


def admit_result(got, evicted: tuple[int, ...] = (0,)) -> OpResult:
    """The ``OpResult`` of an admit, from its pages: the slot-id sum without expanding
    the prompt's slots (slot = page * size + offset, the last page possibly partial).
    ``evicted``: pages freed per pool by its eviction."""
    ps, n, pages = got.page_size, got.num_tokens, got.pages
    full, rest = divmod(n, ps)
    # Python ints on a short row: cheaper than numpy calls there.
    head = sum(pages[:full].tolist()) if pages.size <= _FEW_PAGES else int_sum(pages[:full])
    total = ps * ps * head + full * (ps * (ps - 1) // 2)
    if rest:
        total += rest * ps * int(pages[full]) + rest * (rest - 1) // 2
    return OpResult(got.prefix_len, n, total, *_pair(evicted))


def extend_result(slots: np.ndarray, evicted: tuple[int, ...]) -> OpResult:
    """The ``OpResult`` of an extend: its new slots' count and sum, pages its eviction
    freed per pool."""
    return OpResult(0, int(slots.size), int_sum(slots), *_pair(evicted))


def evict_result(freed: tuple[int, ...]) -> OpResult:
    """The ``OpResult`` of an ``Evict``: pages freed per pool."""
    return OpResult(0, 0, 0, *_pair(freed))


def _pair(pools: tuple[int, ...]) -> tuple[int, int]:
    """Per-pool counts as the op log's (full, SWA) fields; a one-pool cache has no SWA."""
    return pools[0], pools[1] if len(pools) > 1 else 0


def _evicted(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    if before == after:  # most calls evict nothing
        return _NONE_EVICTED
    return tuple(b - a for a, b in zip(before, after, strict=True))


_NONE_EVICTED = (0,)  # as _pair reads it: no page of any pool
_FEW_PAGES = 64


# ---- the mirror's side: a call, and the op every rank must repeat -------------------------
def logged_admit(
    mirror,
    rid: RequestId,
    tokens: TokenLike,
    priority: int,
    reserve: int,
    ns: CacheNamespace | None,
) -> tuple[Any, Admit, OpResult]:
    """Admit on the coordinator's ``mirror`` (which validates and may evict); returns its
    result, the ``Admit`` op every rank applies, and the result each must report. The
    arguments are ``Cache.admit``'s (``ns``: its namespace).

    The op carries the mirror's eviction ask (``eviction_ask``), so a rank repeats the
    mirror's decision exactly. Raises what ``mirror.admit`` raises, having changed nothing.
    """
    rid = check_request_id(rid)  # the plain id the op log carries
    marks = mirror.eviction_marks()
    got = mirror.admit(rid, tokens, priority, reserve=reserve, namespace=ns)
    if type(tokens) is np.ndarray and tokens.dtype == OP_TOKENS:
        data = key_bytes(tokens)  # the values the mirror checked, as they are: no row to read
    else:  # the mirror's checked int32 tokens (its copy, or the caller's immutable buffer)
        data = pack_tokens(mirror.request_row(rid).tokens)
    ask = _pair(mirror.eviction_ask)
    space = as_namespace(ns)  # valid: the mirror took it
    op_ns = None if space is None else OpNamespace(space.lora_id, space.lora_name, space.salt)
    op = Admit(rid, data, priority, ask[0], ask[1], reserve, op_ns)
    return got, op, admit_result(got, _evicted(marks, mirror.eviction_marks()))


def logged_finish(mirror, rid: RequestId, output: TokenLike) -> tuple[int, Finish, OpResult]:
    """Finish ``rid`` on the ``mirror``; returns the cached length, the ``Finish`` op every
    rank applies and the result each must report. Every output token is validated; only
    those that have slots (and so can be cached) go in the op, so an output longer than
    the request's KV costs the ranks nothing. Raises what ``mirror.finish`` raises (and
    ``InvalidTokens`` for the output), having changed nothing."""
    out = as_tokens(output, allow_empty=True)
    row = mirror.request_row(rid)
    out = out[: max(0, row.num_tokens - row.tokens.size)]
    n = mirror.finish(rid, out)
    return n, Finish(rid, key_bytes(out)), OpResult(prefix_len=n)


def op_namespace(ns: OpNamespace | None) -> CacheNamespace | None:
    """The cache's namespace of an ``Admit`` op (``None``: the default one)."""
    return None if ns is None else CacheNamespace(ns.lora_id, ns.lora_name, ns.salt)


def logged_extend(mirror, rid: RequestId, n: int) -> tuple[np.ndarray, Extend, OpResult]:
    """``logged_admit`` for ``extend``: the new slots, the op, the expected result."""
    marks = mirror.eviction_marks()
    slots = mirror.extend(rid, n)
    ask = _pair(mirror.eviction_ask)
    evicted = _evicted(marks, mirror.eviction_marks())
    return slots, Extend(rid, n, *ask), extend_result(slots, evicted)
