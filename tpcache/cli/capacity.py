"""What ``--capacity`` must hold, checked before a command starts anything: ``replay``,
``demo``, ``generate`` and ``serve`` share this one check.

A request holds its prompt and its output at once (``replay`` and ``generate`` admit
both in one allocation, ``demo`` admits the prompt and extends by the output before it
finishes), and the cache refuses a request larger than its pool's whole pages
(``cache.records.request_limit``, the rule used here). Without this check the first
such request failed the run midway: a traceback from ``demo`` and ``generate``, after
the Ray cluster or the model had started.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tpcache.cache.records import request_limit


@dataclass(frozen=True)
class Need:
    """The tokens one request holds at once: its prompt's and its output's."""

    prompt: int
    output: int

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


def largest(sizes: Iterable[tuple[int, int]]) -> Need | None:
    """The largest of ``(prompt, output)`` lengths by their sum (the first of equals);
    None for none."""
    best: Need | None = None
    for prompt, output in sizes:
        if best is None or prompt + output > best.tokens:
            best = Need(int(prompt), int(output))
    return best


def capacity_problem(
    capacity: int | None, page_size: int, need: Need | None = None, option: str = "--capacity"
) -> str | None:
    """What is wrong with ``option`` (a pool of ``capacity`` tokens; None: unbounded) for
    pages of ``page_size`` and a request that holds ``need``, in words a user acts on;
    None if it fits. Changes nothing."""
    if capacity is None:
        return None
    if capacity < page_size:
        return (
            f"{option} {capacity:,} is less than one page of {page_size} tokens "
            f"(--page-size): give {option} {page_size} or more"
        )
    holds = request_limit(capacity // page_size, page_size, None)
    if need is None or need.tokens <= holds:
        return None
    enough = -(-need.tokens // page_size) * page_size
    return (
        f"{option} {capacity:,} holds {holds:,} tokens ({holds // page_size:,} pages of "
        f"{page_size}), but a request of this workload holds {need.tokens:,} at once "
        f"(prompt {need.prompt:,} + output {need.output:,}): give {option} {enough:,} or more"
    )
