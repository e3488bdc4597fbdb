"""Page ids for a trace replay: the input of the page-level simulator (``pagesim``).

A page is identified by its whole prefix (every token from the start of the sequence
to the end of the page), so equal ids mean equal reusable KV. Request ``r``'s sequence
is its prompt followed by its output, by the token rule of ``tpcache.trace``; only whole
pages count. Pages that hold output tokens are unique to their request (no prompt
contains output tokens), so they are never reused, but they take room in a cache.

Not part of the package, and independent of ``tpcache.cache`` on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpcache.trace import (
    BLOCK_TOKENS,
    OUTPUT_TOKEN_BASE,
    TraceRequest,
    output_tokens,
    prompt_tokens,
)


@dataclass(frozen=True)
class PagedReplay:
    """The whole pages of every request of a trace, as interned page ids.

    Ids are dense ints in ``[0, num_ids)``; equal ids mean equal prefixes. Read-only
    after ``build_replay``; simulations share one replay.
    """

    page_size: int
    pages: np.ndarray  # int64; request r's pages, root first, at offsets[r]:offsets[r+1]
    offsets: np.ndarray  # int64, len(requests) + 1
    reuse_limit: np.ndarray  # int64 per request: floor((input_length - 1) / P)
    parent: np.ndarray  # int64 per page id: the previous page of its prefix, -1 for none
    prompt_tokens: int  # all prompt tokens of the trace (the hit-rate denominator)

    @property
    def num_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_ids(self) -> int:
        return len(self.parent)

    def request_pages(self, r: int) -> np.ndarray:
        return self.pages[self.offsets[r] : self.offsets[r + 1]]


def _block_chains(requests: list[TraceRequest]) -> tuple[list[np.ndarray], int]:
    """Intern every prompt's chain of hash ids: chain k of a request names blocks 0..k."""
    ids: dict[tuple[int, int], int] = {}
    chains = []
    for req in requests:
        parent = -1
        chain = []
        for h in req.hash_ids[: req.num_blocks]:
            parent = ids.setdefault((parent, h), len(ids))
            chain.append(parent)
        chains.append(np.asarray(chain, dtype=np.int64))
    return chains, len(ids)


def _pages_by_blocks(requests: list[TraceRequest], page_size: int) -> list[np.ndarray]:
    # Tokens depend only on (hash id, position in block) and different hash ids give
    # disjoint tokens, so a prompt page is named exactly by (block chain, page in block).
    per_block = BLOCK_TOKENS // page_size
    chains, num_chains = _block_chains(requests)
    in_block = np.arange(per_block, dtype=np.int64)
    next_id = num_chains * per_block
    out = []
    for req, chain in zip(requests, chains, strict=True):
        prompt = (chain[:, None] * per_block + in_block[None, :]).reshape(-1)
        prompt = prompt[: req.input_length // page_size]
        # Pages holding output tokens belong to this request alone.
        tail = (req.input_length + req.output_length) // page_size - len(prompt)
        out.append(np.concatenate([prompt, np.arange(next_id, next_id + tail)]))
        next_id += tail
    return out


def _pages_by_hashing(requests: list[TraceRequest], page_size: int) -> list[np.ndarray]:
    ids: dict[tuple[int, bytes], int] = {}
    out = []
    for req in requests:
        seq = np.concatenate([prompt_tokens(req), output_tokens(req)])
        whole = len(seq) // page_size
        pages = seq[: whole * page_size].reshape(whole, page_size)
        parent = -1
        row = np.empty(whole, dtype=np.int64)
        for q in range(whole):
            parent = ids.setdefault((parent, pages[q].tobytes()), len(ids))
            row[q] = parent
        out.append(row)
    return out


def build_replay(
    requests: list[TraceRequest], page_size: int, *, hash_tokens: bool = False
) -> PagedReplay:
    """Intern the pages of ``requests``. Pure; raises ``ValueError`` if ``page_size < 1``.

    When ``page_size`` divides 512 and no prompt token reaches the output token range,
    pages are named from the hash-id chains (fast); otherwise, or with ``hash_tokens``,
    by hashing the synthesised tokens of every page (exact, slower). Both name the same
    pages the same way up to a renumbering.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    max_id = max((max(r.hash_ids[: r.num_blocks]) for r in requests), default=0)
    by_blocks = BLOCK_TOKENS % page_size == 0 and (max_id + 1) * BLOCK_TOKENS < OUTPUT_TOKEN_BASE
    if by_blocks and not hash_tokens:
        rows = _pages_by_blocks(requests, page_size)
    else:
        rows = _pages_by_hashing(requests, page_size)
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pages = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    parent = np.full(int(pages.max()) + 1 if len(pages) else 0, -1, dtype=np.int64)
    for row in rows:
        parent[row[1:]] = row[:-1]
    limits = np.array([(r.input_length - 1) // page_size for r in requests], dtype=np.int64)
    return PagedReplay(
        page_size=page_size,
        pages=pages,
        offsets=offsets,
        reuse_limit=limits,
        parent=parent,
        prompt_tokens=sum(r.input_length for r in requests),
    )


def next_uses(replay: PagedReplay) -> np.ndarray:
    """For each page occurrence (aligned with ``replay.pages``), the next request after it
    whose reusable prefix contains that page; ``replay.num_requests`` when none. Pure."""
    never = replay.num_requests
    soonest = np.full(replay.num_ids, never, dtype=np.int64)
    out = np.empty(len(replay.pages), dtype=np.int64)
    for r in range(replay.num_requests - 1, -1, -1):
        lo, hi = replay.offsets[r], replay.offsets[r + 1]
        seg = replay.pages[lo:hi]
        out[lo:hi] = soonest[seg]
        soonest[seg[: replay.reuse_limit[r]]] = r
    return out
