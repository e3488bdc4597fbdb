"""A hypothesis state machine: RadixCache against a naive reference model.

The model keeps the cached content as a dict from page-aligned token prefixes to the
page id of their last page, the running requests' rows, the handle locks and its own
free FIFO. It predicts every slot id the cache hands out and every match. Which leaves
an eviction takes is the policy's business (asserted exactly in test_cache_policies);
here each eviction is checked to be legal (only unlocked, whole subtrees, enough pages)
and the model then takes the same pages back in the same order. After every op:
check_integrity(), the model equals the tree, and the KV events folded into a block
index equal the cache's content. Hypothesis prints the failing op sequence.
"""

from __future__ import annotations

import pytest
from cache_helpers import cached_prefixes, fold_events, tree_block_index
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tpcache.cache.errors import (
    CacheError,
    InvalidTokens,
    LockError,
    OutOfCapacity,
    UnknownHandle,
    UnknownRequest,
)
from tpcache.cache.policy.policies import CACHE_POLICIES
from tpcache.cache.radix import CacheConfig, RadixCache

CAPACITY_PAGES = 10
RIDS = st.integers(0, 4)
Prefix = tuple[int, ...]


def _blocks(ps: int) -> list[list[int]]:
    # Four distinct pages and a copy of the first with its last token changed, so
    # prompts share whole pages and sometimes diverge inside one.
    blocks = [[10 * b + i + 1 for i in range(ps)] for b in range(4)]
    blocks.append([*blocks[0][:-1], 999])
    return blocks


@st.composite
def token_runs(draw: st.DrawFn, ps: int, max_pages: int = 3, empty: bool = False) -> list[int]:
    blocks = _blocks(ps)
    out: list[int] = []
    for i in draw(st.lists(st.integers(0, len(blocks) - 1), max_size=max_pages)):
        out.extend(blocks[i])
    tail = draw(st.integers(0 if out or empty else 1, ps))
    out.extend(blocks[draw(st.integers(0, len(blocks) - 1))][:tail])
    return out


class Req:
    def __init__(self, tokens: list[int], pages: list[int], cached: int, reserve: int) -> None:
        self.tokens = tokens
        self.pages = pages
        self.num_tokens = len(tokens) + reserve
        self.cached = cached  # leading pages that are the tree's


class CacheMachine(RuleBasedStateMachine):
    page_sizes: tuple[int, ...] = (1, 4, 16)

    # ---- setup --------------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.ps = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        self.policy = data.draw(st.sampled_from(CACHE_POLICIES), label="policy")
        self.cache = RadixCache(
            CacheConfig(CAPACITY_PAGES * self.ps, self.ps, self.policy, record_events=True)
        )
        self.content: dict[Prefix, int] = {}
        self.fifo: list[int] = list(range(CAPACITY_PAGES))
        self.reqs: dict[int, Req] = {}
        self.handles: list[tuple[object, Prefix, bool]] = []  # handle, its prefix, alive
        self.handle_locks: dict[Prefix, int] = {}
        self.index: dict = {}

    # ---- model helpers ------------------------------------------------------------------
    def _longest(self, tokens: list[int], limit: int) -> int:
        ps, m = self.ps, 0
        while m + ps <= limit and tuple(tokens[: m + ps]) in self.content:
            m += ps
        return m

    def _pages_of(self, tokens: list[int], m: int) -> list[int]:
        return [self.content[tuple(tokens[: i + self.ps])] for i in range(0, m, self.ps)]

    def _lock_points(self, extra: Prefix | None = None) -> list[Prefix]:
        points = [tuple(r.tokens[: r.cached * self.ps]) for r in self.reqs.values()]
        points += [p for p, k in self.handle_locks.items() if k]
        if extra is not None:
            points.append(extra)
        return points

    def _locked(self, extra: Prefix | None = None) -> set[Prefix]:
        ps = self.ps
        return {p[:i] for p in self._lock_points(extra) for i in range(ps, len(p) + 1, ps)}

    def _evictable(self, extra: Prefix | None = None) -> int:
        return len(self.content) - len(self._locked(extra) & self.content.keys())

    def _take_eviction(self, short: int, extra: Prefix | None = None) -> int:
        """The cache just evicted: check the pages it took are legal, take them back."""
        now = cached_prefixes(self.cache)
        gone = [p for p in self.content if p not in now]
        locked = self._locked(extra)
        assert not locked.intersection(gone), "a locked prefix was evicted"
        for p in now:
            assert p in self.content and now[p][-1] == self.content[p]
            assert len(p) == self.ps or p[: -self.ps] in now, "eviction left a hole"
        evictable_before = self._evictable(extra)
        event(f"evicted {min(len(gone), 3)}+ prefixes")
        assert len(gone) >= min(short, evictable_before), (len(gone), short, evictable_before)
        pages = sorted(self.content.pop(p) for p in gone)
        self.fifo.extend(pages)
        gone_set = set(gone)
        self.handles = [(h, p, alive and p not in gone_set) for h, p, alive in self.handles]
        return len(pages)

    def _alloc(self, n: int) -> list[int]:
        out, self.fifo = self.fifo[:n], self.fifo[n:]
        return out

    def _insert(self, seq: list[int], pages: list[int]) -> tuple[int, list[int]]:
        """Cache whole pages ``seq`` backed by ``pages``; returns (tokens cached before,
        the tree's pages). Duplicates go back to the FIFO as one sorted group."""
        ps = self.ps
        have = self._longest(seq, len(seq))
        tree_pages, dups = [], []
        for i in range(len(seq) // ps):
            pre = tuple(seq[: (i + 1) * ps])
            if pre in self.content:
                if pages[i] != self.content[pre]:
                    dups.append(pages[i])
            else:
                self.content[pre] = pages[i]
            tree_pages.append(self.content[pre])
        self.fifo.extend(sorted(dups))
        event(f"insert: {'duplicates' if dups else 'no duplicates'}, cached before: {have > 0}")
        return have, tree_pages

    # ---- rules --------------------------------------------------------------------------
    @rule(
        rid=RIDS,
        data=st.data(),
        evict=st.booleans(),
        priority=st.integers(-2, 2),
        reserve=st.sampled_from([0, 0, 1, 3, 17, 40]),
    )
    def admit(
        self, rid: int, data: st.DataObject, evict: bool, priority: int, reserve: int
    ) -> None:
        ps = self.ps
        tokens = data.draw(token_runs(ps), label="prompt")
        if rid in self.reqs:
            with pytest.raises(CacheError):
                self.cache.admit(rid, tokens, priority, reserve=reserve)
            return
        if len(tokens) + reserve > CAPACITY_PAGES * ps:
            with pytest.raises(InvalidTokens):
                self.cache.admit(rid, tokens, priority, reserve=reserve)
            return
        m = self._longest(tokens, (len(tokens) - 1) // ps * ps)
        need = -(-(len(tokens) + reserve) // ps) - m // ps
        point = tuple(tokens[:m])
        short = max(0, need - len(self.fifo))
        if short and (not evict or short > self._evictable(point)):
            with pytest.raises(OutOfCapacity):
                self.cache.admit(rid, tokens, priority, evict=evict, reserve=reserve)
            return
        got = self.cache.admit(rid, tokens, priority, evict=evict, reserve=reserve)
        if short:
            self._take_eviction(short, point)
        pages = self._pages_of(tokens, m) + self._alloc(need)
        assert (got.prefix_len, got.pages.tolist()) == (m, pages)
        assert got.num_tokens == len(tokens) + reserve
        self.reqs[rid] = Req(list(tokens), pages, m // ps, reserve)

    @rule(rid=RIDS, n=st.integers(0, 20), evict=st.booleans())
    def extend(self, rid: int, n: int, evict: bool) -> None:
        ps = self.ps
        req = self.reqs.get(rid)
        if req is None:
            with pytest.raises(UnknownRequest):
                self.cache.extend(rid, n)
            return
        if req.num_tokens + n > CAPACITY_PAGES * ps:
            with pytest.raises(InvalidTokens):
                self.cache.extend(rid, n)
            return
        need = -(-(req.num_tokens + n) // ps) - len(req.pages)
        short = max(0, need - len(self.fifo))
        if short and (not evict or short > self._evictable()):
            with pytest.raises(OutOfCapacity):
                self.cache.extend(rid, n, evict=evict)
            return
        got = self.cache.extend(rid, n, evict=evict)
        if short:
            self._take_eviction(short)
        req.pages += self._alloc(need)
        slots = [p * ps + i for p in req.pages for i in range(ps)]
        assert got.tolist() == slots[req.num_tokens : req.num_tokens + n]
        req.num_tokens += n

    @rule(rid=RIDS, data=st.data())
    def cache_unfinished(self, rid: int, data: st.DataObject) -> None:
        req = self.reqs.get(rid)
        if req is None:
            with pytest.raises(UnknownRequest):
                self.cache.cache_unfinished(rid, [1])
            return
        room = req.num_tokens - len(req.tokens)
        more = data.draw(token_runs(self.ps, 1, empty=True), label="more")[:room]
        tokens = req.tokens + more
        n = len(tokens) // self.ps * self.ps
        assert self.cache.cache_unfinished(rid, tokens) == n
        _, tree_pages = self._insert(tokens[:n], req.pages)
        req.pages[: len(tree_pages)] = tree_pages
        req.cached = len(tree_pages)
        req.tokens = tokens

    @rule(rid=RIDS, data=st.data())
    def finish(self, rid: int, data: st.DataObject) -> None:
        out = data.draw(token_runs(self.ps, 1, empty=True), label="output")
        req = self.reqs.get(rid)
        if req is None:
            with pytest.raises(UnknownRequest):
                self.cache.finish(rid, out)
            return
        seq = req.tokens + out
        n = min(len(seq), req.num_tokens) // self.ps * self.ps
        assert self.cache.finish(rid, out) == n
        _, tree_pages = self._insert(seq[:n], req.pages)
        self.fifo.extend(sorted(req.pages[len(tree_pages) :]))
        del self.reqs[rid]

    @rule(rid=RIDS)
    def abort(self, rid: int) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            with pytest.raises(UnknownRequest):
                self.cache.abort(rid)
            return
        self.cache.abort(rid)
        self.fifo.extend(sorted(req.pages[req.cached :]))

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens: int) -> None:
        short = -(-num_tokens // self.ps)
        got = self.cache.evict(num_tokens)
        freed = self._take_eviction(short)
        assert got.num_tokens == freed * self.ps

    @rule(data=st.data(), priority=st.integers(-2, 2))
    def insert(self, data: st.DataObject, priority: int) -> None:
        ps = self.ps
        tokens = data.draw(token_runs(ps), label="tokens")
        k = -(-len(tokens) // ps)
        if k > len(self.fifo):
            with pytest.raises(OutOfCapacity):
                self.cache.alloc_slots(len(tokens))
            return
        slots = self.cache.alloc_slots(len(tokens))
        pages = self._alloc(k)
        assert slots.tolist() == [p * ps + i for p in pages for i in range(ps)][: len(tokens)]
        n = len(tokens) // ps * ps
        assert self.cache.insert(tokens, slots, priority) == self._longest(tokens, n)
        self._insert(tokens[:n], pages)
        if n < len(tokens):  # the partial last page stays the caller's: give it back
            self.cache.free_slots([pages[-1] * ps + i for i in range(ps)])
            self.fifo.append(pages[-1])

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = data.draw(token_runs(self.ps), label="tokens")
        m = self._longest(tokens, len(tokens) // self.ps * self.ps)
        got = self.cache.match_prefix(tokens)
        assert (got.prefix_len, got.pages.tolist()) == (m, self._pages_of(tokens, m))
        if len(self.handles) < 6:
            self.handles.append((got.handle, tuple(tokens[:m]), True))

    @rule(i=st.integers(0, 5))
    def lock(self, i: int) -> None:
        if i >= len(self.handles):
            return
        h, prefix, alive = self.handles[i]
        if not alive:
            with pytest.raises(UnknownHandle):
                self.cache.lock(h)
            return
        self.cache.lock(h)
        self.handle_locks[prefix] = self.handle_locks.get(prefix, 0) + 1

    @rule(i=st.integers(0, 5))
    def unlock(self, i: int) -> None:
        if i >= len(self.handles):
            return
        h, prefix, alive = self.handles[i]
        if not alive:
            with pytest.raises(UnknownHandle):
                self.cache.unlock(h)
        elif not self.handle_locks.get(prefix):
            with pytest.raises(LockError):
                self.cache.unlock(h)
        else:
            self.cache.unlock(h)
            self.handle_locks[prefix] -= 1

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.content.clear()
        self.fifo = list(range(CAPACITY_PAGES))
        self.reqs.clear()
        self.handle_locks.clear()
        # A reset starts a new generation: every handle given out before it is refused.
        self.handles = [(h, p, False) for h, p, _ in self.handles]

    # ---- after every op ---------------------------------------------------------------------
    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "cache"):
            return
        c, ps = self.cache, self.ps
        c.check_integrity()
        tree = cached_prefixes(c)
        assert {p: pages[-1] for p, pages in tree.items()} == self.content
        a = c.alloc
        assert a.free_order() == self.fifo
        locked = len(self._locked() & self.content.keys())
        held = sum(len(r.pages) - r.cached for r in self.reqs.values())
        s = c.sizes()
        assert (s.free, s.evictable, s.protected, s.held) == (
            len(self.fifo) * ps,
            (len(self.content) - locked) * ps,
            locked * ps,
            held * ps,
        )
        for rid, r in self.reqs.items():
            row = c.reqs.get(rid)
            assert (row.pages.tolist(), row.num_tokens, row.cached_pages) == (
                r.pages,
                r.num_tokens,
                r.cached,
            )
            assert row.tokens.tolist() == r.tokens
        assert set(c.reqs.ids()) == set(self.reqs)
        fold_events(self.index, c.take_events(), ps)
        assert self.index == tree_block_index(c)
        # The events alone rebuild exactly the model's prefixes.
        rebuilt = set()
        for h in self.index:
            toks: list[int] = []
            while h is not None:
                parent, page = self.index[h]
                toks[:0] = page
                h = parent
            rebuilt.add(tuple(toks))
        assert rebuilt == set(self.content)


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _machine(page_size: int) -> type[CacheMachine]:
    return type(f"CacheMachinePs{page_size}", (CacheMachine,), {"page_sizes": (page_size,)})


TestPage1 = settings(SETTINGS)(_machine(1)).TestCase
TestPage4 = settings(SETTINGS)(_machine(4)).TestCase
TestPage16 = settings(SETTINGS)(_machine(16)).TestCase
