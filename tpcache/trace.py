"""Mooncake-format traces and the token rule that turns them into prompts.

A Mooncake trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; each hash id names one 512-token block of the prompt. The trace
carries no tokens, so a replay synthesises them. The rule below is shared with other
tools (simulators, other engines) that must reproduce tpcache's numbers, so it is kept
exactly:

- prompt of request ``r``: its ``k``-th hash id ``h`` gives the block of tokens
  ``h * 512 + i + 1`` for ``i = 0..511``; the concatenated blocks are cut to ``n``;
- output token ``j`` of request ``r``: ``1_000_000_000 + r * 65_536 + j``.

Scaled down by ``1/k`` (``k`` a power of two up to 512), every length is divided by
``k`` and rounded up: a block is ``512 / k`` tokens, ``h * (512 / k) + i + 1``, the
prompt ``ceil(n / k)`` of them and the output the first ``ceil(m / k)`` tokens of the
output rule. ``k = 1`` is the rule above; equal block chains still give equal prefixes.

``r`` is the request's 0-based position among the requests read (blank lines are not
requests). Equal block chains give equal token prefixes and different hash ids give
disjoint tokens, so a prefix cache sees exactly the sharing the trace describes.
Every token fits in int32; a trace that would not is rejected.

A trace file is plain JSONL or gzip-compressed JSONL (told apart by gzip's magic bytes,
not by the name). ``DEFAULT_TRACE`` is the Mooncake conversation trace that ships inside
the package, ``tpcache/data/`` (package data), so it is there in a clone and in every
install.

This module imports only numpy and the standard library (no other tpcache module), so
scripts and other tools can use it alone.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from tpcache.errors import TpcacheError

DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation.jsonl.gz"
_GZIP_MAGIC = b"\x1f\x8b"

BLOCK_TOKENS = 512
OUTPUT_TOKEN_BASE = 1_000_000_000
OUTPUT_TOKENS_PER_REQUEST = 65_536
INT32_MAX = 2**31 - 1

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(TpcacheError, ValueError):
    """A trace line, or a request built by hand, breaks the trace format or the token rule."""


class TraceNotFound(TraceError, FileNotFoundError):
    """There is no trace file at the path given. Both a ``TraceError`` and an ``OSError``
    (``FileNotFoundError``), so a caller that catches either kind sees it."""


class TraceNotText(TraceError, UnicodeError):
    """A trace line that is not UTF-8 text (a binary file, another encoding). Also a
    ``UnicodeError``, the base of the ``UnicodeDecodeError`` reading it raised before."""


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `true` in a trace is a mistake, not a length.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: what its prompt and output are made of, not its tokens.

    Validated on construction (raises ``TraceError``): ``index``, ``timestamp_ms`` and the
    lengths are ints >= 0 with ``input_length >= 1``; hash ids are ints >= 0; the prompt
    is covered by the blocks (``input_length <= 512 * len(hash_ids)``); every prompt and
    output token of the rule fits in int32, and ``output_length <= 65_536`` so that the
    output tokens of two requests never coincide.
    """

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("index", "timestamp_ms", "input_length", "output_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise TraceError(f"{name} must be an int >= 0, got {value!r}")
        if self.input_length < 1:
            raise TraceError("input_length must be >= 1 (an empty prompt is no request)")
        if not isinstance(self.hash_ids, tuple):
            raise TraceError(f"hash_ids must be a tuple, got {type(self.hash_ids).__name__}")
        for h in self.hash_ids:
            if not _is_int(h) or h < 0:
                raise TraceError(f"hash ids must be ints >= 0, got {h!r}")
        covered = BLOCK_TOKENS * len(self.hash_ids)
        if self.input_length > covered:
            raise TraceError(
                f"input_length {self.input_length} exceeds the {len(self.hash_ids)} blocks "
                f"of {BLOCK_TOKENS} tokens ({covered} tokens)"
            )
        blocks_used = self.hash_ids[: self.num_blocks]
        if blocks_used and max(blocks_used) * BLOCK_TOKENS + BLOCK_TOKENS > INT32_MAX:
            raise TraceError(
                f"hash id {max(blocks_used)} makes prompt tokens up to "
                f"{max(blocks_used) * BLOCK_TOKENS + BLOCK_TOKENS}, over int32 ({INT32_MAX})"
            )
        if self.output_length > OUTPUT_TOKENS_PER_REQUEST:
            raise TraceError(
                f"output_length {self.output_length} exceeds {OUTPUT_TOKENS_PER_REQUEST}, "
                "so its output tokens would run into the next request's"
            )
        last_output = self._output_base + self.output_length - 1
        if self.output_length and last_output > INT32_MAX:
            raise TraceError(
                f"request {self.index} with {self.output_length} output tokens reaches token "
                f"{last_output}, over int32 ({INT32_MAX}); the rule allows about "
                f"{(INT32_MAX - OUTPUT_TOKEN_BASE) // OUTPUT_TOKENS_PER_REQUEST} requests"
            )

    @property
    def num_blocks(self) -> int:
        """How many hash ids the prompt uses (the last block may be partial)."""
        return -(-self.input_length // BLOCK_TOKENS)

    @property
    def _output_base(self) -> int:
        return OUTPUT_TOKEN_BASE + self.index * OUTPUT_TOKENS_PER_REQUEST


def prompt_tokens(req: TraceRequest) -> np.ndarray:
    """The prompt of ``req`` by the token rule: int32, length ``input_length``. Pure."""
    ids = np.asarray(req.hash_ids[: req.num_blocks], dtype=np.int64)
    offsets = np.arange(1, BLOCK_TOKENS + 1, dtype=np.int64)
    tokens = (ids[:, None] * BLOCK_TOKENS + offsets[None, :]).reshape(-1)
    return tokens[: req.input_length].astype(np.int32)


def output_tokens(req: TraceRequest) -> np.ndarray:
    """The output of ``req`` by the token rule: int32, length ``output_length``. Pure."""
    return (req._output_base + np.arange(req.output_length, dtype=np.int64)).astype(np.int32)


SCALE_DIVISORS = tuple(2**i for i in range(10))  # 1 .. 512: a block stays whole tokens


def check_scale(divisor: object) -> int:
    """``divisor`` (the ``k`` of a scale ``1/k``) if it is a power of two in [1, 512];
    raises ``TraceError`` otherwise."""
    if not _is_int(divisor) or divisor not in SCALE_DIVISORS:
        raise TraceError(
            f"a scale is 1/k with k a power of two from 1 to {BLOCK_TOKENS} (so a block of "
            f"{BLOCK_TOKENS} tokens stays whole tokens), got k={divisor!r}"
        )
    return int(divisor)  # type: ignore[call-overload]


def scaled_prompt_tokens(req: TraceRequest, divisor: int) -> np.ndarray:
    """The prompt of ``req`` scaled by ``1/divisor`` (see the module docstring): int32,
    length ``ceil(input_length / divisor)``. Pure; raises ``TraceError`` for a bad
    divisor. ``divisor=1`` gives ``prompt_tokens(req)``."""
    block = BLOCK_TOKENS // check_scale(divisor)
    n = -(-req.input_length // divisor)
    ids = np.asarray(req.hash_ids[: -(-n // block)], dtype=np.int64)
    offsets = np.arange(1, block + 1, dtype=np.int64)
    return (ids[:, None] * block + offsets[None, :]).reshape(-1)[:n].astype(np.int32)


def scaled_output_length(req: TraceRequest, divisor: int) -> int:
    """``ceil(output_length / divisor)``: the scaled output's length. Raises ``TraceError``
    for a bad divisor."""
    return -(-req.output_length // check_scale(divisor))


def _parse_line(text: str, index: int) -> TraceRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise TraceError(f"expected a JSON object, got {type(record).__name__}")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise TraceError(f"missing field(s): {', '.join(missing)}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(f"hash_ids must be a list, got {type(hash_ids).__name__}")
    return TraceRequest(
        index=index,
        timestamp_ms=record["timestamp"],
        input_length=record["input_length"],
        output_length=record["output_length"],
        hash_ids=tuple(hash_ids),
    )


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read the first ``limit`` requests (all when ``None``) of the JSONL trace at ``path``,
    plain or gzip-compressed (``DEFAULT_TRACE`` is the trace that ships with tpcache).

    Blank lines are skipped and are not requests; request ``index`` counts the others
    from 0. Raises ``TraceError`` naming the 1-based line number for a malformed line
    (bad JSON, a missing field, a negative length, too few blocks for ``input_length``,
    a non-int or negative hash id, tokens beyond int32) or for gzip data that is cut
    short or corrupt; ``TraceNotText`` (a ``TraceError``) naming the line and the byte in
    it for a line that is not UTF-8; ``TraceNotFound`` (also an ``OSError``) naming the
    path when there is no file there; ``ValueError`` for a negative ``limit``; ``OSError``
    when the file cannot be read. Lines after the ``limit``-th request are not read.
    """
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0 or None, got {limit}")
    requests: list[TraceRequest] = []
    if limit == 0:
        return requests
    line_no = 0
    with _open_text(path) as lines:
        try:
            for line_no, text in enumerate(lines, start=1):
                if not text.isascii():  # (a fast test: a trace is ASCII but for strings)
                    _check_text(path, line_no, text)
                if not text.strip():
                    continue
                try:
                    requests.append(_parse_line(text, len(requests)))
                except TraceError as exc:
                    raise TraceError(f"{path}: line {line_no}: {exc}") from None
                if len(requests) == limit:
                    break
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            # The gzip module reports a cut-short stream as EOFError, not OSError: name the
            # file and how far it read instead of letting a bare EOFError out.
            raise TraceError(f"{path}: bad gzip data after line {line_no}: {exc}") from None
    return requests


def _open_text(path: str | Path) -> IO[str]:
    """The file at ``path`` as text lines, decompressed when it starts with gzip's magic.

    Bytes that are not UTF-8 come through as lone surrogates (``surrogateescape``), for
    ``_check_text`` to name the line they are on: a strict decoder fails a whole chunk
    ahead of the line being read, so it cannot say which line that is."""
    try:
        with open(path, "rb") as raw:
            magic = raw.read(len(_GZIP_MAGIC))
    except FileNotFoundError:
        raise _not_found(path) from None
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")  # the caller closes it


def _check_text(path: str | Path, line_no: int, text: str) -> None:
    """Raise ``TraceNotText`` if ``text`` (line ``line_no``) holds bytes that were not
    UTF-8, naming the first of them and where it is in the line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        offset = len(text[: exc.start].encode("utf-8", "surrogateescape"))
        byte = text[exc.start].encode("utf-8", "surrogateescape")[0]
        raise TraceNotText(
            f"{path}: line {line_no}: not UTF-8 text (byte {byte:#04x} at byte {offset + 1} "
            "of the line); a trace is JSON lines in UTF-8, plain or gzip"
        ) from None


def _not_found(path: str | Path) -> TraceNotFound:
    message = f"no trace file at {path}"
    if Path(path).resolve() == DEFAULT_TRACE:
        message += (
            " (the default trace, shipped inside the tpcache package as tpcache/data/: this"
            " install lacks it, so reinstall tpcache or pass the path of a trace)"
        )
    return TraceNotFound(message)
