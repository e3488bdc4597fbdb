"""Random op sequences on two hybrid caches against a reference model.

The model keeps every cached page-prefix (a token tuple) with its full page and its SWA
page (None: a tombstone's page) and predicts what matching, inserting (with revival),
locking and the pool sizes must give. Eviction choices are the cache's: after an op that
may evict, the model checks that what went was allowed (nothing locked, nothing new, SWA
KV not restored, the targets met or nothing evictable left) and adopts the tree's state.

Two caches get the same ops: the first is a coordinator's mirror (called directly), the
second a TP rank that replays the mirror's op log (``apply_op``, its evictions repeating
the mirror's decision) for the request lifecycle and evictions, and is called directly for
the tree-level calls a frontend makes (match, lock, insert). Their results and digests
must agree after every op, and both pass ``check_integrity()`` after every op. Page sizes
1 and 4, windows of one page up to more than a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tpcache.cache.errors import CacheError, LockError, OutOfCapacity, UnknownHandle
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig, SwaHandle
from tpcache.lockstep.oplog import evict_result, logged_admit, logged_extend
from tpcache.lockstep.ops import Abort, CacheUnfinished, Evict, Finish, OpResult, pack_tokens
from tpcache.workers.protocol import apply_op, local_evict

Key = tuple[int, ...]
_CUT = st.integers(-1, 60) | st.just(-1)  # where a prompt leaves a known sequence


@dataclass
class ModelReq:
    tokens: list[int]
    num_tokens: int
    row: list[int]  # full pages of the row
    cached: int  # leading pages that are the tree's
    own_swa: dict[int, int] = field(default_factory=dict)  # row index -> SWA page


@dataclass
class ModelHandle:
    tokens: list[int]
    handles: tuple[SwaHandle, SwaHandle]
    locks: int = 0
    alive: bool = True


def read_blocks(cache: HybridCache) -> dict[Key, tuple[int, int | None]]:
    ps = cache.page_size
    out: dict[Key, tuple[int, int | None]] = {}
    prefix: dict[int, Key] = {cache.tree.root.id: ()}
    for node in cache.tree.walk():
        toks = prefix[node.parent.id]
        swa = None if node.tombstone else cache.alloc.swa_of(node.pages).tolist()
        for i, page in enumerate(node.pages.tolist()):
            toks = toks + tuple(node.key[i * ps : (i + 1) * ps].tolist())
            out[toks] = (page, None if swa is None else swa[i])
        prefix[node.id] = toks
    return out


class HybridMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1

    @initialize(
        window_pages=st.integers(1, 4),
        full_pages=st.integers(24, 64),
        swa_share=st.sampled_from([1.0, 0.6, 0.4, 0.3]),
        policy=st.sampled_from(["lru", "mru", "fifo", "filo", "lfu", "priority"]),
    )
    def setup(self, window_pages: int, full_pages: int, swa_share: float, policy: str) -> None:
        ps = self.PAGE_SIZE
        self.ps, self.window = ps, window_pages * ps
        swa_pages = max(8, int(full_pages * swa_share))
        cfg = HybridConfig(full_pages * ps, swa_pages * ps, self.window, ps, policy)
        self.caches = (HybridCache(cfg), HybridCache(cfg))
        self.limit = cfg.request_limit
        self.blocks: dict[Key, tuple[int, int | None]] = {}
        self.reqs: dict[int, ModelReq] = {}
        self.handles: list[ModelHandle] = []
        self.known: list[list[int]] = [[]]  # sequences new prompts may continue
        self.next_rid = 0
        self.next_token = 10_000
        self.tail = 4 * ps  # fresh tokens per prompt at most

    # ---- helpers --------------------------------------------------------------------------
    def both(self, name: str, *args, **kwargs):
        """Call ``name`` on both caches: same result or the same error type."""
        out = []
        for c in self.caches:
            try:
                out.append(("ok", getattr(c, name)(*args, **kwargs)))
            except CacheError as exc:
                out.append(("err", type(exc)))
        (k1, v1), (k2, v2) = out
        assert k1 == k2, out
        if k1 == "err":
            assert v1 is v2, out
        else:
            assert _plain(v1) == _plain(v2), (name, v1, v2)
        return k1, v1

    def logged(self, name: str, *args):
        """A lifecycle call on the mirror (caches[0]); its op replayed on the rank
        (caches[1]), whose result must be the mirror's. ("ok", the mirror's result) or
        ("err", error type) with nothing logged."""
        mirror, rank = self.caches
        try:
            if name == "admit":
                got, op, expected = logged_admit(
                    mirror, *args, 0, 0, None
                )  # priority, reserve, namespace
            elif name == "extend":
                got, op, expected = logged_extend(mirror, *args)
            elif name == "evict":
                got = mirror.evict(*args)
                op = Evict(*args)
                ps = self.ps
                expected = evict_result((got.num_tokens // ps, got.swa_tokens // ps))
            elif name == "abort":
                got = mirror.abort(*args)
                op, expected = Abort(*args), OpResult()
            else:
                rid, tokens = args
                got = getattr(mirror, name)(rid, tokens)
                kind = CacheUnfinished if name == "cache_unfinished" else Finish
                op, expected = kind(rid, _packed(tokens)), OpResult(prefix_len=got)
        except CacheError as exc:
            return "err", type(exc)
        assert apply_op(rank, op, local_evict(rank)) == expected, (name, args)
        return "ok", got

    def fresh_tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def prompt(self, base: int, cut: int, tail: list[int]) -> list[int]:
        """A prefix (``cut < 0``: all) of a known sequence and a fresh tail, at most half
        the SWA pool."""
        seq = self.known[base % len(self.known)]
        keep = len(seq) if cut < 0 else cut % (len(seq) + 1)
        keep = min(keep, max(0, self.limit // 2 - len(tail)))
        return seq[:keep] + tail

    def model_match(self, tokens: list[int], n: int) -> int:
        ps, w = self.ps, self.window
        since, seen, best = 0, False, 0
        for p in range(n // ps):
            b = self.blocks.get(tuple(tokens[: (p + 1) * ps]))
            if b is None:
                break
            if b[1] is None:
                since, seen = 0, True
            else:
                since += ps
                if not seen or since >= w:
                    best = (p + 1) * ps
        return best

    def model_insert(self, tokens: list[int], start: int, stop: int, full, swa) -> None:
        """Pages ``start..stop`` of ``tokens`` given anew with ``full``/``swa`` (by index)."""
        for p in range(start, stop):
            key = tuple(tokens[: (p + 1) * self.ps])
            b = self.blocks.get(key)
            if b is None:
                self.blocks[key] = (full[p], swa[p])
            elif b[1] is None:
                self.blocks[key] = (b[0], swa[p])  # revived: the newcomer's SWA page

    def window_ok(self, tokens: list[int], length: int) -> bool:
        for p in range(length // self.ps):
            if (p + 1) * self.ps > length - self.window:
                b = self.blocks.get(tuple(tokens[: (p + 1) * self.ps]))
                if b is None or b[1] is None:
                    return False
        return True

    def reconcile(self, result=None, full_target: int = 0, swa_target: int = 0) -> None:
        """After an op that may evict: check the eviction was allowed, adopt the tree."""
        real = read_blocks(self.caches[0])
        if real == self.blocks and result is None:
            return
        assert set(real) <= set(self.blocks), "an eviction added blocks"
        for key, (full, swa) in real.items():
            mfull, mswa = self.blocks[key]
            assert full == mfull, key
            assert swa is None or swa == mswa, ("SWA KV came back", key)
        self.blocks = real
        for r in self.reqs.values():
            L = r.cached * self.ps
            assert all(tuple(r.tokens[: (p + 1) * self.ps]) in real for p in range(r.cached))
            assert self.window_ok(r.tokens, L), "a request's window lost SWA KV"
        for h in self.handles:
            L = len(h.tokens)
            if h.locks:
                assert self.window_ok(h.tokens, L) and (L == 0 or tuple(h.tokens) in real)
            elif L and tuple(h.tokens) not in real:
                h.alive = False
        if result is not None:
            s = self.caches[0].sizes()
            if result.num_tokens < full_target:
                assert s.evictable == 0, (result, s)
            if result.swa_tokens < swa_target:
                assert s.swa.evictable == 0, (result, s)

    # ---- rules ----------------------------------------------------------------------------
    @rule(base=st.integers(0, 50), cut=_CUT, tail=st.integers(0, 12))
    def admit(self, base: int, cut: int, tail: int) -> None:
        tokens = self.prompt(base, cut, self.fresh_tokens(tail % (self.tail + 1)))
        if not tokens or len(tokens) > self.limit:
            return
        rid = self.next_rid
        self.next_rid += 1
        expect = self.model_match(tokens, (len(tokens) - 1) // self.ps * self.ps)
        before = self.caches[0].digest()
        kind, got = self.logged("admit", rid, tokens)
        if kind == "err":
            assert got is OutOfCapacity
            assert self.caches[0].digest() == before
            return
        assert got.prefix_len == expect
        k = expect // self.ps
        for p in range(k):
            assert got.pages[p] == self.blocks[tuple(tokens[: (p + 1) * self.ps])][0]
        own = got.pages[k:]
        assert got.swa_pages[got.swa_pages.size - own.size :].tolist() == (
            self.caches[0].alloc.swa_of(own).tolist()
        )
        swa = dict(zip(range(k, got.pages.size), got.swa_pages[-own.size :].tolist(), strict=False))
        self.reqs[rid] = ModelReq(
            tokens, len(tokens), got.pages.tolist(), k, swa if own.size else {}
        )
        self.reconcile()

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99), n=st.integers(0, 9))
    def extend(self, pick: int, n: int) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        r = self.reqs[rid]
        if r.num_tokens + n > self.limit:
            return
        kind, got = self.logged("extend", rid, n)
        if kind == "err":
            assert got is OutOfCapacity
            return
        r.num_tokens += n
        row = self.caches[0].reqs.get(rid).pages.tolist()
        new = row[len(r.row) :]
        if new:
            swa = self.caches[0].alloc.swa_of(self.caches[0].reqs.get(rid).pages[len(r.row) :])
            r.own_swa.update(zip(range(len(r.row), len(row)), swa.tolist(), strict=False))
        r.row = row
        self.reconcile()

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99), out=st.integers(0, 9), chunk=st.booleans())
    def finish_or_chunk(self, pick: int, out: int, chunk: bool) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        r = self.reqs[rid]
        extra = self.fresh_tokens(min(out, r.num_tokens - len(r.tokens)) if chunk else out)
        seq = r.tokens + extra
        n = min(len(seq), r.num_tokens) // self.ps
        swa = [r.own_swa.get(p) for p in range(len(r.row))]
        if chunk:
            kind, got = self.logged("cache_unfinished", rid, seq)
            assert kind == "ok" and got == n * self.ps
            self.model_insert(seq, r.cached, n, r.row, swa)
            r.row = self.caches[0].reqs.get(rid).pages.tolist()
            for p in range(n):
                assert r.row[p] == self.blocks[tuple(seq[: (p + 1) * self.ps])][0]
                r.own_swa.pop(p, None)
            r.tokens, r.cached = seq, n
        else:
            kind, got = self.logged("finish", rid, extra)
            assert kind == "ok" and got == n * self.ps
            self.model_insert(seq, r.cached, n, r.row, swa)
            del self.reqs[rid]
            self.known.append(seq)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99))
    def abort(self, pick: int) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        assert self.logged("abort", rid)[0] == "ok"
        del self.reqs[rid]

    @rule(base=st.integers(0, 50), cut=_CUT, tail=st.integers(0, 3), lock=st.booleans())
    def match(self, base: int, cut: int, tail: int, lock: bool) -> None:
        tokens = self.prompt(base, cut, self.fresh_tokens(tail % (self.tail + 1)))
        if not tokens:
            return
        expect = self.model_match(tokens, len(tokens) // self.ps * self.ps)
        results = [c.match_prefix(tokens) for c in self.caches]
        assert _plain(results[0]) == _plain(results[1])
        assert results[0].prefix_len == expect
        h = ModelHandle(tokens[:expect], (results[0].handle, results[1].handle))
        self.handles.append(h)
        if lock:
            for c, handle in zip(self.caches, h.handles, strict=False):
                c.lock(handle)
            h.locks += 1

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 99))
    def relock(self, pick: int) -> None:
        h = self.handles[pick % len(self.handles)]
        errs = []
        for c, handle in zip(self.caches, h.handles, strict=False):
            try:
                c.lock(handle)
                errs.append(None)
            except CacheError as exc:
                errs.append(type(exc))
        assert errs[0] == errs[1]
        if not h.alive:
            assert errs[0] is UnknownHandle
        elif not self.window_ok(h.tokens, len(h.tokens)):
            assert errs[0] is LockError
        else:
            assert errs[0] is None
            h.locks += 1

    @precondition(lambda self: any(h.locks for h in self.handles))
    @rule(pick=st.integers(0, 99))
    def unlock(self, pick: int) -> None:
        locked = [h for h in self.handles if h.locks]
        h = locked[pick % len(locked)]
        for c, handle in zip(self.caches, h.handles, strict=False):
            c.unlock(handle)
        h.locks -= 1

    @rule(full=st.integers(0, 12) | st.just(0), swa=st.integers(0, 12))
    def evict(self, full: int, swa: int) -> None:
        ps = self.ps
        kind, got = self.logged("evict", full * ps, swa * ps)
        assert kind == "ok"
        before = len(self.blocks), sum(b[1] is not None for b in self.blocks.values())
        self.reconcile(got, full * ps, swa * ps)
        after = len(self.blocks), sum(b[1] is not None for b in self.blocks.values())
        assert got.num_tokens == (before[0] - after[0]) * ps
        assert got.swa_tokens == (before[1] - after[1]) * ps

    @rule(swa=st.integers(1, 4))
    def swa_evict(self, swa: int) -> None:
        """Small SWA-only evictions: where tombstones come from."""
        self.evict(0, swa)

    @rule(base=st.integers(0, 50), cut=_CUT, tail=st.integers(1, 12))
    def insert_fresh(self, base: int, cut: int, tail: int) -> None:
        tokens = self.prompt(base, cut, self.fresh_tokens(tail % (self.tail + 1) or 1))
        kind, slots = self.both("alloc_slots", len(tokens))
        if kind == "err":
            return
        ps = self.ps
        n = len(tokens) // ps
        pages = [int(s) // ps for s in slots[::ps]]
        swa = self.caches[0].alloc.swa_of(slots[::ps] // ps).tolist()
        have = self.both("insert", tokens, slots)[1]
        assert have == sum(1 for p in range(n) if tuple(tokens[: (p + 1) * ps]) in self.blocks) * ps
        self.model_insert(tokens, 0, n, pages, swa)
        if len(tokens) % ps:
            page = pages[-1]
            self.both("free_slots", list(range(page * ps, page * ps + ps)))
        self.known.append(tokens)

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "caches"):
            return
        c1, c2 = self.caches
        c1.check_integrity()
        c2.check_integrity()
        assert c1.digest() == c2.digest()
        assert read_blocks(c1) == self.blocks
        ps = self.ps
        s = c1.sizes()
        held = sum(len(r.row) - r.cached for r in self.reqs.values()) * ps
        cached = len(self.blocks) * ps
        swa_cached = sum(b[1] is not None for b in self.blocks.values()) * ps
        assert (s.cached, s.held, s.free) == (cached, held, s.capacity - cached - held)
        assert (s.swa.cached, s.swa.held, s.swa.free) == (
            swa_cached,
            held,
            s.swa.capacity - swa_cached - held,
        )
        assert s.tombstone_tokens == cached - swa_cached


def _packed(tokens: list[int]) -> bytes:
    import numpy as np

    return pack_tokens(np.asarray(tokens, dtype=np.int32))


def _plain(value):
    """Comparable form of a result record (numpy arrays as lists)."""
    if hasattr(value, "__dataclass_fields__"):
        # A handle's owner and tag belong to the cache that gave it out (the tag is keyed
        # by that cache's own secret): they differ by design.
        mine = ("owner", "tag")
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__ if k not in mine}
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


class HybridMachinePage4(HybridMachine):
    PAGE_SIZE = 4


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("machine", [HybridMachine, HybridMachinePage4], ids=["page1", "page4"])
def test_hybrid_cache_against_the_model(machine: type[HybridMachine]) -> None:
    machine.TestCase.settings = _SETTINGS
    machine.TestCase().runTest()


@pytest.mark.parametrize(
    ("page_size", "policy", "seed"),
    [(1, "lru", 1), (1, "mru", 2), (1, "fifo", 3), (4, "mru", 4), (4, "fifo", 5), (4, "lfu", 6)],
)
def test_long_random_walks_against_the_model(page_size: int, policy: str, seed: int) -> None:
    """Long seeded walks through the same rules (hypothesis explores short ones well).
    MRU and FIFO take inner nodes before their leaves, so they make many tombstones."""
    import random

    rng = random.Random(seed)
    print(f"random walk seed {seed}, page size {page_size}, policy {policy}")
    m = (HybridMachine if page_size == 1 else HybridMachinePage4)()
    m.setup(
        window_pages=rng.randint(1, 2),
        full_pages=rng.randint(96, 160),
        swa_share=rng.choice([0.6, 0.4, 0.3]),
        policy=policy,
    )
    cut = lambda: -1 if rng.random() < 0.5 else rng.randint(0, 60)  # noqa: E731
    for _ in range(300):
        op = rng.choices(range(9), weights=[4, 2, 5, 1, 3, 1, 4, 5, 5])[0]
        if op == 0:
            m.admit(base=rng.randint(0, 50), cut=cut(), tail=rng.randint(0, 12))
        elif op == 1 and m.reqs:
            m.extend(pick=rng.randint(0, 99), n=rng.randint(0, 9))
        elif op == 2 and m.reqs:
            m.finish_or_chunk(
                pick=rng.randint(0, 99), out=rng.randint(0, 9), chunk=rng.random() < 0.3
            )
        elif op == 3 and m.reqs:
            m.abort(pick=rng.randint(0, 99))
        elif op == 4:
            m.match(
                base=rng.randint(0, 50), cut=cut(), tail=rng.randint(0, 3), lock=rng.random() < 0.5
            )
        elif op == 5 and m.handles:
            m.relock(pick=rng.randint(0, 99))
        elif op == 6 and any(h.locks for h in m.handles):
            m.unlock(pick=rng.randint(0, 99))
        elif op == 7:
            m.evict(full=rng.randint(0, 6) * (rng.random() < 0.3), swa=rng.randint(1, 6))
        elif op == 8:
            m.insert_fresh(base=rng.randint(0, 50), cut=cut(), tail=rng.randint(1, 12))
        m.agree()
    m.teardown()
