"""The ``resight`` policy: its ghost, its lifetime model, exact eviction orders, a stateful
test, determinism, bad parameters, and its hit rate on a slice of the real trace.

(The shared reference-model state machine, tests/cache/test_cache_property.py, and the
two-instance determinism test, tests/cache/test_cache_determinism.py, also draw ``resight``.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tpcache.cache.errors import CacheError, IntegrityError
from tpcache.cache.policy.ghost import GhostTable
from tpcache.cache.policy.lifetimes import LifetimeModel
from tpcache.cache.policy.policies import CACHE_POLICIES, InvalidPolicyParams
from tpcache.cache.policy.resight import ResightParams, ResightPolicy
from tpcache.cache.radix import CacheConfig, RadixCache

PS = 4


def toks(block: int, pages: int, extra: int = 0) -> list[int]:
    """``pages`` whole pages of tokens unique to ``block``, then ``extra`` more."""
    return [block * 1000 + i for i in range(pages * PS + extra)]


def resight(cap_pages: int, params: ResightParams | None = None, **kw: object) -> RadixCache:
    return RadixCache(
        CacheConfig(cap_pages * PS, PS, "resight", policy_params=params, **kw)  # type: ignore[arg-type]
    )


def serve(cache: RadixCache, rid: object, prompt: list[int], out: list[int] = ()) -> int:  # type: ignore[assignment]
    got = cache.admit(rid, prompt)
    cache.extend(rid, len(out))
    cache.finish(rid, out)
    cache.check_integrity()
    return got.prefix_len


def policy_of(cache: RadixCache) -> ResightPolicy:
    hooks = cache.tree.hooks
    assert isinstance(hooks, ResightPolicy)
    return hooks


# ---- the ghost ---------------------------------------------------------------------------
def test_ghost_returns_runs_keeps_remainders_and_drops_the_oldest() -> None:
    g = GhostTable(8)
    a = np.array([11, 12, 13], dtype=np.uint64)
    b = np.array([14, 15], dtype=np.uint64)  # a run that continued a (its child node)
    g.put(a, 5, 0)
    g.put(b, 6, 1)
    assert len(g) == 5
    # The first new page starts run a; the walk goes on into run b; 16 was never seen.
    assert g.take(np.array([11, 12, 13, 14, 15, 16], dtype=np.uint64)) == [(3, 5, 0), (2, 6, 1)]
    assert len(g) == 0
    # A run that comes back in part: the rest stays, keyed by its own first page.
    g.put(a, 7, 1)
    assert g.take(np.array([11, 12, 99], dtype=np.uint64)) == [(2, 7, 1)]
    assert len(g) == 1
    assert g.take(np.array([13], dtype=np.uint64)) == [(1, 7, 1)]
    assert g.take(np.array([12], dtype=np.uint64)) == []  # inside no remembered run start
    # Over capacity the run stored longest ago goes first.
    g.put(np.arange(100, 105, dtype=np.uint64), 1, 0)
    g.put(np.arange(200, 204, dtype=np.uint64), 2, 0)
    assert len(g) == 4
    assert g.take(np.array([100], dtype=np.uint64)) == []
    assert g.take(np.array([200, 201], dtype=np.uint64)) == [(2, 2, 0)]
    g.check_integrity()


def test_ghost_integrity_check_fails_on_a_planted_break() -> None:
    g = GhostTable(8)
    g.put(np.array([1, 2], dtype=np.uint64), 3, 0)
    g.check_integrity()
    g.pages += 1
    with pytest.raises(IntegrityError, match="runs hold 2 pages, counter 3"):
        g.check_integrity()


# ---- the lifetime model --------------------------------------------------------------------
def _feed(model: LifetimeModel, ticks: int, once: int, again: int, gap: int) -> None:
    """Per tick: ``once`` class-0 pages never seen again, ``again`` class-1 pages that come
    back ``gap`` ticks later."""
    for t in range(1, ticks + 1):
        model.advance(1)
        model.visit(0, once)
        model.visit(1, again)
        if t > gap:
            model.reuse(1, gap, again)
        if t % 10 == 0:
            model.snapshot()


def test_model_gives_one_off_pages_no_lifetime_and_reused_pages_their_gap() -> None:
    model = LifetimeModel(2, capacity_pages=40, halve_every=10**9)
    _feed(model, 200, once=20, again=2, gap=8)
    t0, t1 = model.solve().tolist()  # type: ignore[union-attr]
    assert t0 == 0  # one-offs are never hit: no room for them
    assert t1 > 8  # re-used pages outlive their gap (then nothing more to gain)
    roomy = LifetimeModel(2, capacity_pages=10**6, halve_every=10**9)
    _feed(roomy, 200, once=20, again=2, gap=8)
    assert roomy.solve() is None  # everything fits: nothing to choose, plain LRU


def test_model_does_not_count_young_intervals_as_never_reused() -> None:
    # Every class-1 visit comes back 50 ticks later. After 120 ticks, 70 of the 120 visits
    # have come back: the other 50 are too young to tell, not never reused.
    model = LifetimeModel(2, capacity_pages=10, halve_every=10**9)
    _feed(model, 120, once=0, again=1, gap=50)
    model.snapshot()
    assert int(model.reuses[1].sum()) / int(model.visits[1]) < 0.6  # the naive ratio
    hits, _, lifetimes = model.curves()
    at = int(np.searchsorted(lifetimes, 64))  # a lifetime of 64 > the gap
    assert hits[1, at] >= 0.9 * model.visits[1]  # nearly every visit would be a hit
    assert hits[1, at - 3] == 0  # a lifetime of 32 < the gap: none


# ---- exact orders in the tree -----------------------------------------------------------------
def test_a_page_seen_before_comes_back_as_an_upper_node_of_the_higher_class() -> None:
    cache = resight(8)
    pol = policy_of(cache)
    assert serve(cache, "r1", toks(1, 2, extra=1)) == 0  # A: 2 pages, class 0
    assert serve(cache, "r2", toks(2, 6, extra=1)) == 0  # X evicts A: A to the ghost
    assert len(pol.ghost) == 2
    # A again, then one new page B: A is cached again from its ghost sighting, split from B.
    assert serve(cache, "r3", [*toks(1, 2), *toks(3, 1, extra=1)]) == 0
    nodes = cache.tree.walk()
    assert [(n.key.tolist(), n.hits) for n in nodes] == [(toks(1, 2), 1), (toks(3, 1), 0)]
    upper, lower = nodes
    assert lower.parent is upper
    assert len(pol.ghost) == 6  # X went in (6 pages), A came out
    assert pol.key(upper) == (upper.last_access + pol.bonus[1], upper.id)
    assert pol.key(lower) == (lower.last_access + pol.bonus[0], lower.id)


def test_bonus_orders_seen_before_leaves_after_fresh_ones_and_needs_a_rekey() -> None:
    cache = resight(64)
    pol = policy_of(cache)
    slots = {}
    for name in "AC":  # inserted and then matched: class 1, older than B and D
        slots[name] = cache.alloc_slots(PS)
        cache.insert(toks(ord(name), 1), slots[name])
    for name in "AC":
        cache.match_prefix(toks(ord(name), 1))
    for name in "BD":  # inserted later, never matched: class 0
        slots[name] = cache.alloc_slots(PS)
        cache.insert(toks(ord(name), 1), slots[name])

    def order() -> str:
        names = {tuple(toks(ord(n), 1)): n for n in "ABCD"}
        keyed = sorted((pol.key(n), names[tuple(n.key.tolist())]) for n in cache.tree.walk())
        return "".join(name for _, name in keyed)

    assert pol.bonus == [0, 0]
    assert order() == "ACBD"  # plain LRU
    pol.bonus = [0, 10]
    with pytest.raises(IntegrityError, match="not in the eviction queue"):
        cache.check_integrity()  # keys changed, heap not rebuilt: caught
    cache.tree.rekey()
    cache.check_integrity()
    assert order() == "BDAC"
    gone = ""
    while cache.tree.cached_pages:
        before = {n.key[0] for n in cache.tree.walk()}
        assert cache.evict(PS).num_tokens == PS
        (first,) = before - {n.key[0] for n in cache.tree.walk()}
        gone += chr(int(first) // 1000)
    assert gone == "BDAC"


def _hot_and_scan(cache: RadixCache, rounds: int) -> list[int]:
    """A 4-page prefix used once a round; between uses, six one-off 4-page prompts (24
    pages, more than the 16-page cache). Returns the hot prefix's hit per round."""
    hits = []
    for r in range(rounds):
        hits.append(serve(cache, f"hot{r}", [*toks(1, 4), 9000 + r]))
        for i in range(6):
            serve(cache, f"scan{r}.{i}", toks(10 + 6 * r + i, 4, extra=1))
    return hits


def test_a_scan_of_one_off_prompts_does_not_evict_a_prefix_seen_before() -> None:
    lru = RadixCache(CacheConfig(16 * PS, PS, "lru"))
    assert _hot_and_scan(lru, 8) == [0] * 8  # LRU: the scan flushes it every round
    cache = resight(16)
    # Round 0: seen once, evicted by the scan, remembered by the ghost. Round 1: seen
    # again, cached as class 1; by then the model has learned that class 1 comes back
    # and class 0 does not, so from round 2 on the scan goes first and it stays.
    assert _hot_and_scan(cache, 8) == [0, 0, 16, 16, 16, 16, 16, 16]
    pol = policy_of(cache)
    assert pol.lifetimes is not None and pol.lifetimes[0] < pol.lifetimes[1]
    assert pol.bonus == [0, pol.lifetimes[1] - pol.lifetimes[0]]


# ---- bad parameters --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"ghost_factor": 0},
        {"ghost_factor": -1.0},
        {"ghost_factor": 65},
        {"ghost_factor": "8"},
        {"ghost_factor": True},
        {"classes": 1},
        {"classes": 4},
        {"classes": 2.0},
        {"classes": False},
    ],
)
def test_bad_parameters_raise_a_typed_error(kwargs: dict) -> None:
    with pytest.raises(InvalidPolicyParams) as err:
        ResightParams(**kwargs)
    assert isinstance(err.value, CacheError) and isinstance(err.value, ValueError)


def test_parameters_must_belong_to_the_policy() -> None:
    with pytest.raises(InvalidPolicyParams, match="'lru' takes no parameters"):
        CacheConfig(64, 4, "lru", policy_params=ResightParams())
    with pytest.raises(InvalidPolicyParams, match="takes ResightParams, got dict"):
        CacheConfig(64, 4, "resight", policy_params={"ghost_factor": 8})
    with pytest.raises(CacheError, match="unknown policy 'resite'"):
        CacheConfig(64, 4, "resite")
    assert "resight" in CACHE_POLICIES
    cache = resight(16, ResightParams(ghost_factor=2, classes=3))
    pol = policy_of(cache)
    assert (pol.k, pol.ghost.capacity, len(pol.bonus)) == (3, 32, 3)


def test_reset_forgets_the_policy_state() -> None:
    cache = resight(8)
    serve(cache, "a", toks(1, 2, extra=1))
    serve(cache, "b", toks(2, 7, extra=1))
    pol = policy_of(cache)
    assert len(pol.ghost) > 0 and pol.model.visits.any()
    cache.reset()
    assert len(pol.ghost) == 0 and not pol.model.visits.any() and pol.bonus == [0, 0]
    cache.check_integrity()


# ---- determinism --------------------------------------------------------------------------------
def _ops(seed: int, n: int) -> list[tuple]:
    rng = random.Random(seed)
    blocks = [toks(b, 1) for b in range(8)]
    out: list[tuple] = []
    for i in range(n):
        prompt = [t for _ in range(rng.randint(1, 5)) for t in rng.choice(blocks)]
        prompt += [7000 + i] * rng.randint(0, PS - 1)
        kind = rng.choices(["serve", "match", "evict", "abort"], [10, 2, 1, 1])[0]
        out.append((kind, i, prompt, rng.randint(0, 2 * PS)))
    return out


def _run(seed: int, n: int) -> list[list]:
    """Apply ``_ops``; per step: the result, the digest, the events, the policy state."""
    cache = resight(12, record_events=True)
    pol = policy_of(cache)
    trail = []
    for kind, i, prompt, extra in _ops(seed, n):
        try:
            if kind == "serve":
                got = cache.admit(i, prompt)
                cache.extend(i, extra)
                cache.finish(i, list(range(5000, 5000 + extra)))
                res: object = [got.prefix_len, got.slots.tolist()]
            elif kind == "abort":
                cache.admit(i, prompt)
                res = cache.abort(i)
            elif kind == "match":
                res = cache.match_prefix(prompt).prefix_len
            else:
                res = cache.evict(extra).num_tokens
        except CacheError as exc:
            res = type(exc).__name__
        events = [repr(e) for e in cache.take_events()]
        trail.append(
            [res, cache.digest(), events, pol.bonus, len(pol.ghost), pol.model.visits.tolist()]
        )
    cache.check_integrity()
    return trail


def test_two_instances_fed_the_same_ops_evict_the_same_at_every_step() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    a, b = _run(seed, 400), _run(seed, 400)
    assert a == b
    assert any(step[2] and "BlockRemoved" in " ".join(step[2]) for step in a)


def test_the_same_ops_give_the_same_evictions_in_a_fresh_process() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    here = _run(seed, 200)
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_policy_resight import _run\n"
        "print(json.dumps(_run(int(sys.argv[2]), 200)))\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(Path(__file__).parent),
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "4242"},
    )
    assert json.loads(proc.stdout) == json.loads(json.dumps(here))


# ---- a stateful test: random lifecycles, integrity after every op ------------------------
class ResightMachine(RuleBasedStateMachine):
    """Requests come and go over a small vocabulary (so prefixes repeat, pages go to the
    ghost and come back), with tree-level matches, inserts and evictions in between."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = resight(10, ResightParams(ghost_factor=2))
        self.running: dict[int, list[int]] = {}
        self.next_id = 0

    prompts = st.lists(st.integers(0, 4), min_size=1, max_size=4).flatmap(
        lambda bs: st.integers(0, PS - 1).map(
            lambda t: [x for b in bs for x in toks(b, 1)] + [9] * t
        )
    )

    @rule(prompt=prompts)
    def admit(self, prompt: list[int]) -> None:
        try:
            self.cache.admit(self.next_id, prompt)
            self.running[self.next_id] = prompt
        except CacheError:
            pass
        self.next_id += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data(), out=st.integers(0, 2 * PS), abort=st.booleans())
    def end(self, data: st.DataObject, out: int, abort: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]
        if abort:
            self.cache.abort(rid)
            return
        try:
            self.cache.extend(rid, out)
        except CacheError:
            out = 0
        self.cache.finish(rid, list(range(8000, 8000 + out)))

    @rule(prompt=prompts)
    def match(self, prompt: list[int]) -> None:
        self.cache.match_prefix(prompt)

    @rule(prompt=prompts)
    def insert(self, prompt: list[int]) -> None:
        n = len(prompt) // PS * PS
        try:
            slots = self.cache.alloc_slots(n)
        except CacheError:
            return
        self.cache.insert(prompt[:n], slots)

    @rule(n=st.integers(0, 12 * PS))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()  # conservation, tree, heap keys, ghost, model
        s = self.cache.sizes()
        assert s.free + s.evictable + s.protected + s.held == s.capacity


TestResightMachine = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)(ResightMachine).TestCase


# ---- the real trace --------------------------------------------------------------------------
def test_on_a_slice_of_the_trace_it_hits_at_least_as_often_as_lru() -> None:
    from tpcache.replay import ReplayOptions, replay
    from tpcache.trace import DEFAULT_TRACE, load_trace

    requests = load_trace(DEFAULT_TRACE, 1000)
    got = {
        p: replay(requests, ReplayOptions(capacity=1_000_000, page_size=16, policy=p))["hit_rate"]
        for p in ("lru", "resight")
    }
    print(got)
    assert got["resight"] >= got["lru"]
