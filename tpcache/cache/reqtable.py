"""The request-to-slot table: one row of pages per running request.

A row's first ``cached_pages`` pages belong to the tree (the request's locked prefix);
the rest are HELD by the request. Rows are kept in admission order (a dict), so any
walk over them is the same in every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tpcache.cache.allocator import HELD, PageAllocator
from tpcache.cache.errors import (
    CacheError,
    DuplicateRequest,
    IntegrityError,
    InvalidTokens,
    OutOfCapacity,
    UnknownRequest,
)
from tpcache.cache.host.node import HostNode
from tpcache.cache.keys import joined_key, pages_to_slots, read_only
from tpcache.cache.namespace import is_anchor
from tpcache.cache.records import RequestId, RequestRow
from tpcache.cache.tree.node import Node

if TYPE_CHECKING:
    from tpcache.cache.namespace import CacheNamespace
    from tpcache.cache.tree.shapes import TreeShape

MAX_ID_LEN = 256
_I64 = 1 << 63


class Asked(NamedTuple):
    """An admit's inputs, checked: the new id, the tokens (the row keeps them), the
    priority and the row's total length."""

    rid: RequestId
    key: np.ndarray
    prio: int
    total: int


# What an admit matched beyond its device prefix, to load (a host tier's): the nodes
# matched whole, the node where the match stops part-way, and its common tokens.
Beyond = tuple[list[HostNode], HostNode | None, int]


class Locked(NamedTuple):
    """What an admit locked: its matched ``path`` (``pos`` tokens), the lock's end
    ``node`` and, with a window, its SWA lock's ``top``."""

    path: list[Node]
    pos: int
    node: Node
    top: Node | None


class Taken(NamedTuple):
    """An admit's row (matched pages, then its own), where its lock ends and the tokens
    it got from the cache: ``pos`` in all, ``loaded`` of them from the host tier."""

    row: np.ndarray
    node: Node
    pos: int
    loaded: int


@dataclass(slots=True)
class Req:
    """A running request. Owned by its cache; fields change only through its methods."""

    rid: RequestId
    tokens: np.ndarray  # int32: the tokens the cache was told about so far
    pages: np.ndarray  # int64: every page of the row, in token order
    num_tokens: int  # slots held (tokens with KV, or about to have it)
    cached_pages: int  # leading pages that are the tree's
    node: Node  # the locked end of the cached prefix
    priority: int
    mark: int  # the boundary mark of its lock's window (tree.find_top); 0: no window
    space: CacheNamespace | None = None  # its namespace (None: the default one)


def finished_tail(req: Req, out: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """What ``finish`` caches of ``req`` with output ``out``: the tokens after the row's
    cached prefix, up to the whole pages that have KV; the row's pages for them; and the
    cached length.

    Only that tail is walked and copied (the prefix is the locked path to ``req.node``):
    for a long conversation it is a small part. It may be empty (a finish still touches
    the path).
    """
    ps = page_size
    end = min(req.tokens.size + out.size, req.num_tokens) // ps * ps
    start = req.cached_pages * ps
    tail = req.tokens[start:end]
    if end > req.tokens.size:
        tail = joined_key(tail, out[: end - req.tokens.size])
    return tail, req.pages[start // ps : end // ps], end


def admitted_length(size: int, reserve: Any, limit: int) -> int:
    """The slots an admit takes: the prompt's ``size`` tokens and ``reserve`` more (output
    slots allocated with the prompt); raises (changing nothing) ``CacheError`` for a bad
    ``reserve``, ``InvalidTokens`` past the request limit."""
    total = size + check_count(reserve, "reserve")
    if total > limit:
        extra = f" + {reserve} reserved" if reserve else ""
        raise InvalidTokens(f"prompt of {size} tokens{extra} exceeds the limit {limit}")
    return total


def extended_length(req: Req, n: Any, limit: int) -> int:
    """The token count of ``req`` after ``extend(n)``; raises (changing nothing)
    ``CacheError`` for a bad ``n``, ``InvalidTokens`` past the request limit."""
    end = req.num_tokens + check_count(n, "extend's n")
    if end > limit:
        raise InvalidTokens(f"request {req.rid!r} would hold {end} tokens, limit {limit}")
    return end


_FEW_SLOTS = 4  # up to this many, slots are computed in Python (a decode step's one)


def row_slots(req: Req, start: int, end: int, page_size: int) -> np.ndarray:
    """Slot ids of tokens ``start..end`` of ``req``'s row (a new array)."""
    if end - start <= _FEW_SLOTS:
        # A decode step's extend: a Python loop beats numpy's fixed cost at this size
        # (results/group_timings.md).
        pages = req.pages
        ps = page_size
        return np.array([int(pages[t // ps]) * ps + t % ps for t in range(start, end)], np.int64)
    first = start // page_size
    skip = start - first * page_size
    return pages_to_slots(req.pages[first:], page_size, end - first * page_size)[skip:]


def refuse_room(
    need: int,
    page_size: int,
    frees: tuple[int, ...],
    evictable: tuple[int, ...] | None,
    names: tuple[str, ...],
) -> None:
    """Raise ``OutOfCapacity`` unless ``need`` pages fit every pool: its free pages, plus
    what eviction could free there (``evictable``; ``None``: eviction not allowed)."""
    labels = names if len(frees) > 1 else ("",) * len(frees)
    if evictable is None:
        if need > min(frees):
            free = " and ".join(
                f"{f} {label}".rstrip() for f, label in zip(frees, labels, strict=True)
            )
            raise OutOfCapacity(f"need {need} pages, {free} free (eviction not allowed here)")
    elif any(need > f + e for f, e in zip(frees, evictable, strict=True)):
        pools = ", ".join(
            f"{label} {f} free + {e} evictable".lstrip()
            for f, e, label in zip(frees, evictable, labels, strict=True)
        )
        raise OutOfCapacity(f"need {need} pages of {page_size}: {pools}")


def check_extends(rid: RequestId, known: np.ndarray, key: np.ndarray, limit: int) -> None:
    """Raise ``InvalidTokens`` unless ``key`` extends ``known`` and fits ``limit`` slots."""
    if key.size < known.size or not np.array_equal(key[: known.size], known):
        raise InvalidTokens(f"tokens for {rid!r} do not extend the {known.size} tokens it has")
    if key.size > limit:
        raise InvalidTokens(f"{key.size} tokens for {rid!r}, but it holds KV for only {limit}")


def check_count(value: Any, what: str) -> int:
    """``value`` if it is an int in 0 .. 2**63 - 1 (a count of tokens; counts travel in the
    op log as int64), else ``CacheError`` naming ``what``. A bool is refused: ``True`` is
    an int, but never a count."""
    if type(value) is int and 0 <= value < _I64:  # the common case, in one test
        return value
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _I64:
        raise CacheError(f"{what} must be an int in [0, 2**63), got {value!r}")
    return int(value)


def as_priority(priority: object) -> int:
    """A priority: an int in the int64 range (it travels in the op log), never a bool."""
    if type(priority) is int and -_I64 <= priority < _I64:  # the common case, in one test
        return priority
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise CacheError(f"priority must be an int, got {priority!r}")
    if not -_I64 <= priority < _I64:
        raise CacheError(f"priority must fit in int64, got {priority}")
    return int(priority)


def check_request_id(rid: Any) -> RequestId:
    """A request id, as the plain ``int`` or ``str`` it will be known by.

    An int in the range the op log's encoding carries (-2**63 .. 2**64 - 1), or a
    non-empty str of at most 256 chars that encodes as UTF-8 (no lone surrogates). A
    subclass (``np.str_``, an int enum) is taken as its plain value, so that any later
    call with an equal id finds it; a bool is refused. Raises ``CacheError``.
    """
    t = type(rid)
    if t is int:
        if not -_I64 <= rid < 2 * _I64:
            raise CacheError(f"request id {rid} does not fit in 64 bits")
        return rid
    if t is str:
        if not 0 < len(rid) <= MAX_ID_LEN:
            raise CacheError(f"request id must have 1..{MAX_ID_LEN} chars, got {len(rid)}")
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise CacheError(f"request id {rid!r} is not valid UTF-8: {exc.reason}") from None
        return rid
    if isinstance(rid, bool) or not isinstance(rid, int | str):
        raise CacheError(f"request id must be an int or str, got {type(rid).__name__}")
    return check_request_id(int(rid) if isinstance(rid, int) else str.__str__(rid))


class ReqTable:
    """The running requests by id, in admission order. Owned by one cache."""

    def __init__(self) -> None:
        self._rows: dict[RequestId, Req] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, rid: object) -> bool:
        """Whether ``rid`` (as ``check_request_id`` takes it) is running; never raises."""
        try:
            return check_request_id(rid) in self._rows
        except CacheError:
            return False

    def ids(self) -> list[RequestId]:
        return list(self._rows)

    def check_new(self, rid: Any) -> RequestId:
        """The id a new request will be known by (``check_request_id``); raises
        ``CacheError`` for a bad id, ``DuplicateRequest`` for a running one."""
        rid = check_request_id(rid)
        if rid in self._rows:
            raise DuplicateRequest(f"request {rid!r} is already running")
        return rid

    def get(self, rid: Any) -> Req:
        # A running request's id was checked when it came in; an exact int or str found
        # here needs no second check (a bool equal to a running int id is not one).
        t = type(rid)
        if t is int or t is str:
            req = self._rows.get(rid)
            if req is not None:
                return req
        plain = check_request_id(rid)
        req = self._rows.get(plain)
        if req is None:
            raise UnknownRequest(f"no running request {plain!r}")
        return req

    def row(self, rid: Any, page_size: int) -> RequestRow:
        """``rid``'s row as a read-only record (``get`` raises as it does)."""
        req = self.get(rid)
        return RequestRow(
            req.rid,
            read_only(req.tokens),
            read_only(req.pages),
            req.num_tokens,
            req.cached_pages * page_size,
            page_size,
        )

    def add(
        self,
        rid: RequestId,
        tokens: np.ndarray,
        pages: np.ndarray,
        num_tokens: int,
        cached_pages: int,
        node: Node,
        priority: int,
        mark: int,
        space: CacheNamespace | None = None,
    ) -> None:
        self._rows[rid] = Req(
            rid, tokens, pages, num_tokens, cached_pages, node, priority, mark, space
        )

    def remove(self, rid: RequestId) -> None:
        del self._rows[rid]

    def held_pages(self) -> int:
        return sum(r.pages.size - r.cached_pages for r in self._rows.values())

    def check_integrity(self, tree: TreeShape, alloc: PageAllocator) -> None:
        """Each row's prefix is its node's path; its own pages are HELD and nobody else's."""
        ps = alloc.page_size
        own: list[np.ndarray] = []
        for req in self._rows.values():
            node = req.node
            if node is not tree.root and (not node.alive or node.lock <= 0):
                raise IntegrityError(f"request {req.rid!r} holds an evicted or unlocked node")
            path_pages = []
            path_keys = []
            while node is not tree.root and not is_anchor(node):
                path_pages.append(node.pages)
                path_keys.append(node.key)
                node = node.parent  # type: ignore[assignment]
            if node is not tree.root and tree.spaces[node.kb][0] != req.space:
                raise IntegrityError(f"request {req.rid!r} is locked in another namespace")
            path = np.concatenate(path_pages[::-1]) if path_pages else np.zeros(0, np.int64)
            if path.size != req.cached_pages or not np.array_equal(path, req.pages[: path.size]):
                raise IntegrityError(
                    f"request {req.rid!r}: row prefix of {req.cached_pages} pages differs from its"
                    f" tree path of {path.size} pages"
                )
            keys = np.concatenate(path_keys[::-1]) if path_keys else np.zeros(0, np.int32)
            if not np.array_equal(keys, req.tokens[: keys.size]):
                raise IntegrityError(
                    f"request {req.rid!r}: its tokens differ from the {keys.size} tokens of its"
                    " tree path"
                )
            if req.pages.size != -(-req.num_tokens // ps):
                raise IntegrityError(
                    f"request {req.rid!r} has {req.pages.size} pages for {req.num_tokens} tokens"
                )
            if req.tokens.size > req.num_tokens:
                raise IntegrityError(f"request {req.rid!r} knows more tokens than it has slots for")
            own.append(req.pages[req.cached_pages :])
        if own:
            flat = np.concatenate(own)
            if np.unique(flat).size != flat.size:
                raise IntegrityError("a page is held by two request rows")
            if flat.size and (alloc.tags_of(flat) != HELD).any():
                raise IntegrityError("a request's own page is not tagged held")
