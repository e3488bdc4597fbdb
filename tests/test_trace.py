"""The trace loader and token rule (tpcache.trace), and the page-level reference
simulator of scripts/belady.py, checked by hand and against a naive per-page model."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import tpcache.trace
from tpcache.trace import (
    DEFAULT_TRACE,
    TraceError,
    TraceNotFound,
    TraceRequest,
    load_trace,
    output_tokens,
    prompt_tokens,
)

# scripts/ is not a package: its modules import each other by name.
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from page_replay import build_replay, next_uses  # noqa: E402
from pagesim import POLICIES, simulate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# data/README.md gives this digest of the uncompressed trace.
TRACE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def _line(n: int, m: int, ids: list[object], ts: object = 0) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": m, "hash_ids": ids})


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _req(index: int, ids: list[int], n: int, m: int = 0) -> TraceRequest:
    return TraceRequest(index, 0, n, m, tuple(ids))


# --- the token rule -----------------------------------------------------------------


def test_prompt_tokens_follow_the_rule_and_are_cut_to_input_length(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(600, 3, [3, 7]), _line(1, 0, [5, 9])])
    first, second = load_trace(path)
    assert first == TraceRequest(0, 0, 600, 3, (3, 7))
    expected = [3 * 512 + i + 1 for i in range(512)] + [7 * 512 + i + 1 for i in range(88)]
    tokens = prompt_tokens(first)
    assert tokens.dtype == np.int32
    assert tokens.tolist() == expected
    assert prompt_tokens(second).tolist() == [5 * 512 + 1]


def test_output_tokens_follow_the_rule(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(1, 2, [0]), "", _line(1, 3, [0]), _line(1, 0, [0])])
    reqs = load_trace(path)
    assert [r.index for r in reqs] == [0, 1, 2]  # a blank line is no request
    assert output_tokens(reqs[0]).tolist() == [1_000_000_000, 1_000_000_001]
    out = output_tokens(reqs[1])
    assert out.dtype == np.int32
    assert out.tolist() == [1_000_000_000 + 65_536 + j for j in range(3)]
    assert output_tokens(reqs[2]).tolist() == []


# --- malformed lines ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ('{"timestamp": 0, "input_length": 5', "bad JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "output_length"),
        (_line(-1, 0, [1]), "input_length"),
        (_line(0, 0, [1]), "input_length"),
        (_line(5, -2, [1]), "output_length"),
        (_line(5, 0, [1], ts=-3), "timestamp"),
        (_line(513, 0, [1]), "exceeds"),
        (_line(5, 0, ["1"]), "hash ids"),
        (_line(5, 0, [1.5]), "hash ids"),
        (_line(5, 0, [True]), "hash ids"),
        (_line(5, 0, [-1]), "hash ids"),
        (_line(5, 0, [4_194_303]), "int32"),
        (_line(5, 65_537, [1]), "output_length"),
        (
            json.dumps({"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": 1}),
            "list",
        ),
    ],
)
def test_malformed_line_raises_trace_error_naming_the_line(
    tmp_path: Path, bad: str, words: str
) -> None:
    path = _write(tmp_path, [_line(5, 0, [1]), "", bad, _line(5, 0, [1])])
    with pytest.raises(TraceError, match=rf"line 3: .*{words}"):
        load_trace(path)


def test_trace_error_is_a_value_error() -> None:
    assert issubclass(TraceError, ValueError)
    with pytest.raises(ValueError):
        _req(0, [1], 600)


def test_limit_reads_only_the_first_requests(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(5, 0, [1]), _line(6, 0, [2]), "not json"])
    assert [r.input_length for r in load_trace(path, limit=2)] == [5, 6]
    assert load_trace(path, limit=0) == []
    with pytest.raises(TraceError, match="line 3"):
        load_trace(path, limit=3)
    with pytest.raises(ValueError, match="limit"):
        load_trace(path, limit=-1)


# --- reading files: gzip, missing files, the default trace ------------------------------


def test_a_gzip_trace_reads_like_the_plain_one_whatever_its_name(tmp_path: Path) -> None:
    plain = _write(tmp_path, [_line(600, 3, [3, 7]), "", _line(5, 0, [1]), _line(9, 2, [4])])
    # No .gz suffix: the loader goes by gzip's magic bytes, not by the name.
    packed = tmp_path / "trace.bin"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert len(load_trace(plain)) == 3
    assert load_trace(packed) == load_trace(plain)
    assert load_trace(packed, limit=2) == load_trace(plain, limit=2)


# Each damage is found at a different place: the end of a cut stream (EOFError), the
# trailer's CRC or the header's method byte (gzip.BadGzipFile), the first deflate block
# (zlib.error).
@pytest.mark.parametrize("damage", ["cut", "crc", "method", "block"])
def test_damaged_gzip_data_raises_trace_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    lines = [_line(5, i % 7, [i]) for i in range(2000)]
    data = bytearray(gzip.compress("\n".join(lines).encode()))
    if damage == "cut":
        data = data[: len(data) // 2]
    elif damage == "crc":
        data[-8] ^= 0xFF  # the trailer: CRC-32 of the data, then its size
    elif damage == "method":
        data[2] = 0  # the header: 8 (deflate) is the only method there is
    else:
        data[10] ^= 0xFF  # the first deflate block, right after the 10-byte header
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(
        TraceError, match=rf"^{re.escape(str(path))}: bad gzip data after line \d+: "
    ):
        load_trace(path)


def test_a_missing_trace_raises_trace_not_found_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(TraceNotFound, match=f"^no trace file at {re.escape(str(path))}$") as info:
        load_trace(path)
    # one type for both kinds of caller: those that catch OSError and those that catch TraceError
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, TraceError)


def test_a_missing_default_trace_says_where_it_ships(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = (tmp_path / "data" / "mooncake_conversation.jsonl.gz").resolve()
    monkeypatch.setattr(tpcache.trace, "DEFAULT_TRACE", gone)
    with pytest.raises(
        TraceNotFound,
        match=rf"^no trace file at {re.escape(str(gone))} \(the default trace, shipped inside "
        r"the tpcache package as tpcache/data/: this install lacks it",
    ):
        load_trace(gone)


def test_the_default_trace_is_the_compressed_file_in_the_repository() -> None:
    assert DEFAULT_TRACE == REPO / "tpcache" / "data" / "mooncake_conversation.jsonl.gz"
    assert DEFAULT_TRACE.read_bytes()[:2] == b"\x1f\x8b"
    with gzip.open(DEFAULT_TRACE, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == TRACE_SHA256


def test_int32_guard_on_prompt_tokens() -> None:
    # 4_194_302 * 512 + 512 = 2**31 - 512 fits; one more id reaches 2**31.
    assert int(prompt_tokens(_req(0, [4_194_302], 512))[-1]) == 2**31 - 512
    with pytest.raises(TraceError, match="int32"):
        _req(0, [4_194_303], 1)
    _req(0, [1, 4_194_303], 512)  # an unused block does not count


def test_int32_guard_on_output_tokens(tmp_path: Path) -> None:
    # Request 17_509's outputs start at 2_147_469_824: 13_824 of them fit exactly.
    last = output_tokens(_req(17_509, [0], 1, 13_824))[-1]
    assert int(last) == 2**31 - 1
    with pytest.raises(TraceError, match="int32"):
        _req(17_509, [0], 1, 13_825)
    lines = [_line(1, 0, [0])] * 17_509 + [_line(1, 13_825, [0])]
    with pytest.raises(TraceError, match=r"line 17510: .*int32"):
        load_trace(_write(tmp_path, lines))


def test_real_trace_loads_within_int32() -> None:
    reqs = load_trace(DEFAULT_TRACE)
    assert len(reqs) == 12_031
    assert sum(r.input_length for r in reqs) == 144_793_823
    assert max(max(r.hash_ids) for r in reqs) * 512 + 512 < 2**31 - 1


# --- the page-level simulator, by hand ----------------------------------------------


def _hits(reqs: list[TraceRequest], policy: str, pages: float, tree: bool = False) -> int:
    """Hit pages of a replay at page size 512 (a page is a block)."""
    result = simulate(build_replay(reqs, 512), policy, pages * 512, tree=tree)  # type: ignore[arg-type]
    return result.hit_tokens // 512


# Nine requests over three shared first blocks, in a cycle: 1, 2, 3, 1, 2, 3, ...
# Each has two pages (the shared block, then a block of its own) and may reuse one.
CYCLE = [_req(r, [1 + r % 3, 100 + r], 1024) for r in range(9)]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(
    ("policy", "pages"),
    [
        # Every request after the first three reuses its shared block.
        ("inf", 6),
        # Four pages: each request's two evict the oldest request's two, which hold
        # the very block needed next.
        ("lru", 0),
        # Own blocks are never used again and go first; the three shared blocks fit.
        ("belady", 6),
        # Requests 0-2 only remember, 3-5 admit their shared block, 6-8 reuse it.
        ("admit2-lru", 3),
    ],
)
def test_hand_worked_cycle(policy: str, pages: int, tree: bool) -> None:
    assert _hits(CYCLE, policy, 4, tree) == pages


def test_output_pages_take_room_and_reuse_stops_before_the_last_prompt_token() -> None:
    reqs = [
        _req(0, [7, 8], 1024, 600),  # pages: [7], [7 8], then one of output tokens only
        _req(1, [7, 8, 9], 1100),  # may reuse 2 pages: [7], [7 8]
        _req(2, [7, 8], 1024),  # may reuse 1 page: its last prompt token is computed
    ]
    assert _hits(reqs, "inf", math.inf) == 3
    # Request 0 alone is over two pages: it stays, its output page goes at request 1.
    replay = build_replay(reqs, 512)
    for capacity in (1, 2):
        result = simulate(replay, "lru", capacity * 512)
        assert (result.hit_tokens, result.evicted_pages) == (3 * 512, 1)
    assert result.prompt_tokens == 1024 + 1100 + 1024


def test_next_uses_count_only_reusable_prefixes() -> None:
    # Request 1 holds page [1 2] but may not reuse it (its last prompt token is there),
    # so request 0's [1 2] is next used by request 2.
    reqs = [_req(0, [1, 2], 1024), _req(1, [1, 2], 1024), _req(2, [1, 2, 3], 1536)]
    replay = build_replay(reqs, 512)
    never = replay.num_requests
    assert next_uses(replay).tolist() == [1, 2, 2, 2, never, never, never]


# --- the page-level simulator, against a naive model --------------------------------


def _naive(reqs: list[TraceRequest], page: int, policy: str, cap: float, tree: bool) -> int:
    """Hit pages by the definition, one page at a time, with pages named by token bytes."""
    names: dict[tuple[int, bytes], int] = {}
    paths = []
    for req in reqs:
        seq = np.concatenate([prompt_tokens(req), output_tokens(req)])
        path, parent = [], -1
        for q in range(len(seq) // page):
            parent = names.setdefault(
                (parent, seq[q * page : (q + 1) * page].tobytes()), len(names)
            )
            path.append(parent)
        paths.append(path)
    parent_of = {p: (path[d - 1] if d else -1) for path in paths for d, p in enumerate(path)}
    depth = {p: d for path in paths for d, p in enumerate(path)}
    reusable = [
        set(path[: (r.input_length - 1) // page]) for r, path in zip(reqs, paths, strict=True)
    ]

    def next_use(r: int, p: int) -> int:
        return next((s for s in range(r + 1, len(reqs)) if p in reusable[s]), len(reqs))

    cached: dict[int, tuple[int, int]] = {}  # page -> (priority, last access)
    ghost: dict[int, int] = {}  # page -> number of its first sighting
    handed, hits = 0, 0
    for r, path in enumerate(paths):
        for p in path[: (reqs[r].input_length - 1) // page]:
            if p not in cached:
                break
            hits += 1
        keep = path
        if policy == "admit2-lru":
            seen = [p not in cached and p in ghost and handed - ghost[p] <= 8 * cap for p in path]
            ok = [p in cached or s for p, s in zip(path, seen, strict=True)]
            if tree:
                ok = [all(ok[: d + 1]) for d in range(len(ok))]
            keep = [p for p, k in zip(path, ok, strict=True) if k]
            for p, k, s in zip(path, ok, seen, strict=True):
                if k:
                    ghost.pop(p, None)
                elif not s:
                    ghost[p], handed = handed, handed + 1
        for p in keep:
            cached[p] = (-next_use(r, p) if policy == "belady" else 0, r)
        while policy != "inf" and len(cached) > cap:
            parents = {parent_of[q] for q in cached}
            victims = [q for q in cached if cached[q][1] != r and not (tree and q in parents)]
            if not victims:
                break
            del cached[min(victims, key=lambda q: (*cached[q], -depth[q]))]
    return hits


def _synthetic(seed: int, n: int = 80) -> list[TraceRequest]:
    """Conversations that grow by whole blocks over a few shared system prompts; every
    prompt ends in a partial block and outputs vary, so pages straddle both edges."""
    rng = np.random.default_rng(seed)
    systems = [[0], [0, 1], [2]]
    convs: list[list[int]] = []
    fresh, reqs = 10, []
    for r in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(list(systems[rng.integers(len(systems))]))
        chain = convs[rng.integers(len(convs))]
        for _ in range(rng.integers(1, 3)):
            chain.append(fresh)
            fresh += 1
        n_in = 512 * (len(chain) - 1) + int(rng.integers(1, 513))
        reqs.append(TraceRequest(r, 0, n_in, int(rng.integers(0, 700)), tuple(chain)))
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_matches_naive_model(policy: str, tree: bool, seed: int) -> None:
    print(f"seed {seed}")
    reqs, cap = _synthetic(seed), 40
    fast = simulate(build_replay(reqs, 128), policy, cap * 128, tree=tree)  # type: ignore[arg-type]
    assert fast.hit_tokens // 128 == _naive(reqs, 128, policy, cap, tree)


def test_page_size_not_dividing_512_uses_token_hashing() -> None:
    reqs = _synthetic(7, n=50)
    for policy in ("lru", "belady"):
        fast = simulate(build_replay(reqs, 384), policy, 50 * 384)
        assert fast.hit_tokens // 384 == _naive(reqs, 384, policy, 50, False)


@pytest.fixture(scope="module")
def real_slice() -> list[TraceRequest]:
    return load_trace(DEFAULT_TRACE, limit=300)


@pytest.mark.parametrize("page", [16, 128])
def test_block_naming_equals_token_hashing(page: int) -> None:
    reqs = _synthetic(3)
    by_blocks = build_replay(reqs, page)
    by_hashing = build_replay(reqs, page, hash_tokens=True)
    assert len(by_blocks.pages) == len(by_hashing.pages)
    for policy in POLICIES:
        a = simulate(by_blocks, policy, 40 * 128)
        b = simulate(by_hashing, policy, 40 * 128)
        assert (a.hit_tokens, a.evicted_pages) == (b.hit_tokens, b.evicted_pages), policy


def test_belady_beats_lru_on_real_slice(real_slice: list[TraceRequest]) -> None:
    replay = build_replay(real_slice, 16)
    lru = simulate(replay, "lru", 300_000)
    belady = simulate(replay, "belady", 300_000)
    unbounded = simulate(replay, "inf")
    assert lru.hit_rate < belady.hit_rate <= unbounded.hit_rate
    assert belady.hit_rate > 0.05
