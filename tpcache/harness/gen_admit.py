"""Who the serving loop of ``tpcache generate`` (``gen_loop``) may admit next: a running
request's record, and the two admission rules (the module docstring of ``gen_loop``
says why they are these). Pure functions of the running requests and the cache's sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tpcache.cache.records import CacheSizes
from tpcache.harness.gen_wire import GenerateError


@dataclass
class Run:
    """A running request; owned by the loop."""

    seq: int
    ident: bytes
    prompt: np.ndarray
    max_new: int
    done: int = 0  # prompt tokens with KV
    prefix_len: int = 0
    computed: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.done < self.prompt.size


def would_match_more(running: Iterable[Run], prompt: np.ndarray, cached: int, ps: int) -> bool:
    """Whether a prompt still in prefill shares more whole pages (of ``ps`` tokens) with
    ``prompt`` than the cache gives it now (``cached``; the match an admit may make: at
    most len - 1 tokens)."""
    bound = (prompt.size - 1) // ps * ps
    for run in running:
        if not run.prefilling:
            continue
        n = min(bound, run.prompt.size // ps * ps)
        if n <= cached:
            continue
        diff = np.flatnonzero(run.prompt[:n] != prompt[:n])
        if (int(diff[0]) if diff.size else n) // ps * ps > cached:
            return True
    return False


def fits(
    running: Iterable[Run], sizes: CacheSizes, length: int, cached: int, ps: int, seq: int
) -> bool:
    """Whether request ``seq``, whose row will reach ``length`` tokens, ``cached`` of them
    from the cache, fits next to what the running requests' rows will still grow by, in
    whole pages, free or evictable. Raises ``GenerateError`` if it could never fit
    (nothing else runs and it does not fit)."""
    pending = 0
    anyone = False
    for r in running:
        anyone = True
        now = r.done if r.prefilling else r.prompt.size + len(r.out) - 1
        pending += _pages(r.prompt.size + r.max_new - 1, ps) - _pages(now, ps)
    want = _pages(length, ps) - cached // ps
    room = (sizes.free + sizes.evictable) // ps
    if want + pending <= room:
        return True
    if not anyone:
        raise GenerateError(
            f"request {seq} needs {want * ps} tokens of cache, it has "
            f"{room * ps} free or evictable (capacity {sizes.capacity})"
        )
    return False


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)
