"""Determinism: the same op sequence gives the same digests and slot ids, in this process
and in a fresh one with another hash seed; one different op changes the digest at once.

Plain seeded random ops (the seed is printed, so a failure can be replayed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tpcache.cache.errors import CacheError
from tpcache.cache.policy.policies import CACHE_POLICIES
from tpcache.cache.radix import CacheConfig, RadixCache

Op = tuple


def random_ops(seed: int, ps: int, n: int) -> list[Op]:
    """``n`` random ops over a small vocabulary of pages, so prompts share prefixes."""
    rng = random.Random(seed)
    blocks = [[100 * b + i for i in range(ps)] for b in range(6)]

    def tokens(max_pages: int = 4) -> list[int]:
        out = [t for _ in range(rng.randint(0, max_pages)) for t in rng.choice(blocks)]
        return out + rng.choice(blocks)[: rng.randint(0 if out else 1, ps)]

    rids = ["r0", "r1", 2, 3, "long-request-id"]
    ops: list[Op] = []
    for _ in range(n):
        kind = rng.choices(
            [
                "admit",
                "extend",
                "unfinished",
                "finish",
                "abort",
                "evict",
                "match",
                "insert",
                "reset",
            ],
            weights=[8, 6, 3, 6, 1, 2, 3, 2, 0.2],
        )[0]
        rid = rng.choice(rids)
        if kind == "admit":
            ops.append(("admit", rid, tokens(), rng.randint(0, 3)))
        elif kind == "extend":
            ops.append(("extend", rid, rng.randint(0, 2 * ps)))
        elif kind == "unfinished":
            ops.append(("unfinished", rid, tokens(1)))
        elif kind == "finish":
            ops.append(("finish", rid, tokens(1)))
        elif kind == "abort":
            ops.append(("abort", rid))
        elif kind == "evict":
            ops.append(("evict", rng.randint(0, 6 * ps)))
        elif kind == "match":
            ops.append(("match", tokens()))
        elif kind == "insert":
            ops.append(("insert", tokens(), rng.randint(0, 3)))
        else:
            ops.append(("reset",))
    return ops


def apply(cache: RadixCache, op: Op) -> object:
    """Apply ``op``; its result (slot ids, lengths) or the name of the error it raised."""
    try:
        match op:
            case ("admit", rid, toks, prio):
                got = cache.admit(rid, toks, prio)
                return [got.prefix_len, got.slots.tolist()]
            case ("extend", rid, n):
                return cache.extend(rid, n).tolist()
            case ("unfinished", rid, more):
                req = cache.reqs.get(rid)
                known = req.tokens.tolist()
                return cache.cache_unfinished(
                    rid, (known + more)[: max(len(known), req.num_tokens)]
                )
            case ("finish", rid, out):
                return cache.finish(rid, out)
            case ("abort", rid):
                return cache.abort(rid)
            case ("evict", n):
                got = cache.evict(n)
                return [got.num_tokens, got.num_nodes]
            case ("match", toks):
                got = cache.match_prefix(toks)
                return [got.prefix_len, got.slots.tolist()]
            case ("insert", toks, prio):
                slots = cache.alloc_slots(len(toks))
                have = cache.insert(toks, slots, prio)
                ps = cache.page_size
                if len(toks) % ps:
                    first = int(slots[-1]) // ps * ps
                    cache.free_slots(list(range(first, first + ps)))
                return [have, slots.tolist()]
            case ("reset",):
                return cache.reset()
    except CacheError as exc:
        return type(exc).__name__
    raise AssertionError(op)


def run(seed: int, ps: int, policy: str, n: int) -> list[list[object]]:
    cache = RadixCache(CacheConfig(12 * ps, ps, policy, record_events=True))
    out = []
    for op in random_ops(seed, ps, n):
        result = apply(cache, op)
        out.append([result, cache.digest(), len(cache.take_events())])
    cache.check_integrity()
    return out


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_two_caches_fed_the_same_ops_agree_at_every_step(policy: str, ps: int) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed} policy={policy} page_size={ps}")
    a = RadixCache(CacheConfig(12 * ps, ps, policy, record_events=True))
    b = RadixCache(CacheConfig(12 * ps, ps, policy, record_events=True))
    kinds = set()
    for step, op in enumerate(random_ops(seed, ps, 300)):
        ra, rb = apply(a, op), apply(b, op)
        assert ra == rb, (step, op)
        assert a.digest() == b.digest(), (step, op)
        assert a.take_events() == b.take_events(), (step, op)
        kinds.add(op[0] if not isinstance(ra, str) else f"{op[0]}:{ra}")
        if step % 50 == 0:
            a.check_integrity()
    a.check_integrity()
    assert {"admit", "finish", "extend", "evict", "match"} <= kinds, kinds


@pytest.mark.parametrize("ps", [1, 4])
def test_one_different_op_changes_the_digest_at_that_step(ps: int) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    ops = random_ops(seed, ps, 200)
    a = RadixCache(CacheConfig(12 * ps, ps, "lru"))
    b = RadixCache(CacheConfig(12 * ps, ps, "lru"))
    # The same insert, but one token of its first page differs.
    mine = list(range(7000, 7000 + ps))
    other = [*mine[:-1], 9999]
    for step, op in enumerate(ops):
        if step == 100:
            a.reset()
            b.reset()
            ra, rb = apply(a, ("insert", mine, 0)), apply(b, ("insert", other, 0))
            assert ra == rb  # the same slots...
            assert a.digest() != b.digest()  # ...but other contents
            break
        apply(a, op)
        apply(b, op)
        assert a.digest() == b.digest()


def test_digest_sees_what_differs_between_two_caches() -> None:
    def fresh() -> RadixCache:
        c = RadixCache(CacheConfig(32, 1))
        c.admit("a", [1, 2, 3, 4])
        c.finish("a")
        return c

    base = fresh().digest()
    assert fresh().digest() == base
    variants = {
        "a running request": lambda c: c.admit("b", [9]),
        "a lock": lambda c: c.lock(c.match_prefix([1, 2, 3, 4]).handle),
        "a split": lambda c: c.match_prefix([1, 2, 9]),
        "an access": lambda c: c.match_prefix([1, 2, 3, 4]),
        "an eviction": lambda c: c.evict(1),
        "lent slots": lambda c: c.alloc_slots(1),
        "other slots, same content": lambda c: (
            c.reset(),
            c.alloc_slots(1),
            c.admit("a", [1, 2, 3, 4]),
            c.finish("a"),
        ),
    }
    seen = {base}
    for name, change in variants.items():
        c = fresh()
        change(c)
        d = c.digest()
        assert d not in seen, name
        seen.add(d)


def test_the_same_ops_give_the_same_digests_in_a_fresh_process() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    here = run(seed, 4, "lfu", 200)
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_cache_determinism import run\n"
        "print(json.dumps(run(int(sys.argv[2]), 4, 'lfu', 200)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
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
        env=env,
    )
    assert json.loads(proc.stdout) == json.loads(json.dumps(here))
