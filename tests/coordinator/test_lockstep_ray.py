"""TP ranks as Ray actors in lockstep, checked against one in-process cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from drill_worker import DrillWorker, expected_token_kv
from group_helpers import group_config

from tpcache.cache import errors
from tpcache.cache.radix import RadixCache
from tpcache.frontend import api
from tpcache.frontend.frontend import handle
from tpcache.frontend.service import start_group
from tpcache.workers.protocol import DivergenceError


@pytest.fixture(scope="module")
def groups(ray_cluster):
    made = {}

    def get(tp: int):
        if tp not in made:
            made[tp] = start_group(group_config(tp), worker_cls=DrillWorker)
        coord = made[tp]
        coord.reset()
        coord.sync()
        return coord

    yield get
    for coord in made.values():
        coord.close()


def workload(seed: int, n: int = 120) -> list[tuple]:
    """Random calls with shared prefixes, chunked prefill, aborts and eviction pressure."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 60))] for _ in range(6)]
    calls: list[tuple] = []
    running: dict[int, list[int]] = {}
    nxt = 0
    for _ in range(n):
        r = rng.random()
        if r < 0.45 or not running:
            prompt = rng.choice(prefixes) + [
                rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))
            ]
            # Some admits take their first output slots with the prompt (reserve).
            calls.append(("admit", nxt, prompt, rng.choice([0, 0, 0, 1, 5, 12])))
            running[nxt] = prompt
            nxt += 1
        else:
            rid = rng.choice(sorted(running))
            kind = rng.random()
            if kind < 0.5:
                out = [rng.randrange(1, 500) for _ in range(rng.randrange(0, 12))]
                calls.append(("extend", rid, len(out)))
                calls.append(("finish", rid, out))
                del running[rid]
            elif kind < 0.7:
                calls.append(("abort", rid))
                del running[rid]
            else:
                more = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 20))]
                calls.append(("extend", rid, len(more)))
                running[rid] = running[rid] + more
                calls.append(("cache_unfinished", rid, running[rid]))
    for rid in sorted(running):
        calls.append(("finish", rid, []))
    return calls


def apply_call(target, call: tuple):
    kind, rid, *rest = call
    try:
        if kind == "admit":
            got = target.admit(rid, rest[0], reserve=rest[1])
            return ("admit", got.prefix_len, got.slots.tolist())
        if kind == "extend":
            more = target.extend(rid, rest[0])  # a cache's slots, a coordinator's record
            return ("extend", getattr(more, "slots", more).tolist())
        if kind == "finish":
            return ("finish", target.finish(rid, rest[0]))
        if kind == "cache_unfinished":
            got = target.cache_unfinished(rid, rest[0])
            return ("cu", getattr(got, "cached_len", got))
        target.abort(rid)
        return ("abort",)
    except errors.CacheError as exc:
        return ("error", type(exc).__name__)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_match_one_in_process_cache(groups, tp):
    seed = 1234 + tp
    print(f"seed={seed}")
    coord = groups(tp)
    local = RadixCache(coord.mirror.config)
    calls = workload(seed)
    queried = coord.stats()["query_tokens"]
    for i, call in enumerate(calls):
        want = apply_call(local, call)
        got = apply_call(coord, call)
        assert got == want, f"call {i} {call[:2]}: {got} != {want}"
        if got[0] == "admit":
            queried += len(call[2])  # prompt tokens only, not the reserve
        if i % 10 == 0:
            assert coord.mirror.digest() == local.digest()
    coord.sync()
    assert local.tree.evicted_pages > 0
    digests = coord.ranks.call("digest")
    assert digests == [local.digest()] * tp
    assert coord.stats()["divergences"] == 0
    assert coord.stats()["hit_tokens"] > 0
    assert coord.stats()["query_tokens"] == queried
    for info in coord.ranks.call("info"):
        assert info["last_step"] == coord.stats()["steps_sent"] - 1
    coord.ranks.call("check_integrity")


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_written_is_read_back_at_prefix_hit(groups, tp):
    coord = groups(tp)
    prompt = np.arange(100, 100 + 37, dtype=np.int32)
    first = coord.admit("kv-a", prompt)
    coord.sync()
    coord.ranks.call("write_token_kv", first.slots, prompt)
    coord.finish("kv-a")
    follow = np.concatenate((prompt[:30], np.array([7, 8, 9], dtype=np.int32)))
    hit = coord.admit("kv-b", follow)
    assert hit.prefix_len == 28  # whole pages of the 29 reusable tokens
    np.testing.assert_array_equal(hit.slots[:28], first.slots[:28])
    coord.sync()
    spec = group_config(tp).worker_spec().pool
    for layer in range(spec.num_layers):
        reads = coord.ranks.call("read_kv", layer, hit.slots[:28])
        for rank, (k, v) in enumerate(reads):
            ek, ev = expected_token_kv(spec, rank, layer, prompt[:28])
            np.testing.assert_array_equal(k, ek.numpy())
            np.testing.assert_array_equal(v, ev.numpy())
        # each rank holds its own head shard: the shards differ between ranks
        assert not np.array_equal(reads[0][0], reads[1][0])
    coord.finish("kv-b")
    coord.sync()


def test_bad_input_is_rejected_and_changes_nothing(groups):
    coord = groups(2)
    coord.admit("ok", list(range(1, 20)))
    coord.sync()
    before = coord.ranks.call("digest")
    mirror_before = coord.mirror.digest()
    steps_before = coord.stats()["steps_sent"]
    bad = [
        (errors.UnknownRequest, lambda: coord.finish("nobody")),
        (errors.DuplicateRequest, lambda: coord.admit("ok", [1, 2, 3])),
        (errors.InvalidTokens, lambda: coord.admit("empty", [])),
        (errors.InvalidTokens, lambda: coord.admit("huge", list(range(1, 400)))),
        (errors.InvalidTokens, lambda: coord.admit("neg", [1, -2, 3])),
        (errors.InvalidTokens, lambda: coord.admit("float", [1.5, 2.0])),
        (errors.CacheError, lambda: coord.admit(3.5, [1, 2])),
        (errors.CacheError, lambda: coord.admit("r", [1, 2], reserve=-1)),
        (errors.CacheError, lambda: coord.admit("r", [1, 2], reserve=True)),
        (errors.CacheError, lambda: coord.admit("r", [1, 2], reserve=2.0)),
        (errors.InvalidTokens, lambda: coord.admit("r", list(range(1, 20)), reserve=10_000)),
        (errors.InvalidTokens, lambda: coord.extend("ok", 10_000)),
        (errors.CacheError, lambda: coord.extend("ok", -1)),
        (errors.UnknownRequest, lambda: coord.abort("nobody")),
    ]
    for err, call in bad:
        with pytest.raises(err):
            call()
    coord.finish("ok")
    with pytest.raises(errors.UnknownRequest):
        coord.finish("ok")  # finish twice
    coord.sync()
    assert coord.stats()["steps_sent"] == steps_before + 1  # only the good finish was logged
    after = coord.ranks.call("digest")
    assert after[0] == after[1] == coord.mirror.digest()
    assert before[0] == mirror_before
    # out of capacity: a prompt that fits the limit but not the pool while others hold it
    held = [
        coord.admit(f"hold{i}", list(range(2000 + 1000 * i, 2000 + 1000 * i + 199)))
        for i in range(3)
    ]
    assert all(h.prefix_len == 0 for h in held)
    coord.sync()
    d = coord.ranks.call("digest")
    with pytest.raises(errors.OutOfCapacity):
        coord.admit("toomuch", list(range(5000, 5250)))
    coord.sync()
    assert coord.ranks.call("digest") == d
    for i in range(3):
        coord.abort(f"hold{i}")
    coord.sync()


def test_msgspec_api_rejects_malformed_messages(groups):
    coord = groups(2)
    d0 = coord.mirror.digest()
    for data in (
        b"",
        b"\xff\x00garbage",
        api.encode(api.AdmitCall("x", [1, 2, 3]))[:-2],
        b"\x82\xa4call\xa5admit\xa3bad\x01",
    ):
        reply = api.decode_reply(handle(coord, data))
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest"
    # unknown field
    import msgspec

    raw = msgspec.msgpack.encode({"call": "abort", "request_id": "x", "extra": 1})
    reply = api.decode_reply(handle(coord, raw))
    assert isinstance(reply, api.ErrorReply) and "extra" in reply.message
    assert coord.mirror.digest() == d0
    ok = api.decode_reply(handle(coord, api.encode(api.AdmitCall("m", list(range(1, 12)), 0, 5))))
    assert isinstance(ok, api.AdmitReply) and len(ok.slots) == 11 + 5  # the reserve's too
    d1 = coord.mirror.digest()
    err = api.decode_reply(handle(coord, api.encode(api.AdmitCall("m", [1]))))
    assert isinstance(err, api.ErrorReply) and err.error == "DuplicateRequest"
    assert coord.mirror.digest() == d1
    assert isinstance(api.decode_reply(handle(coord, api.encode(api.AbortCall("m")))), api.OkReply)
    coord.sync()
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2


def test_planted_divergence_is_caught_at_its_step(ray_cluster):
    coord = start_group(group_config(2), worker_cls=DrillWorker)
    try:
        coord.admit("a", list(range(1, 30)))
        coord.finish("a")
        coord.sync()
        bad_step = coord.stats()["steps_sent"]
        coord.ranks.call_on(1, "inject_fault", bad_step, "corrupt")
        coord.admit("b", list(range(1, 40)))  # this step's Admit is corrupted on rank 1
        with pytest.raises(DivergenceError) as caught:
            coord.sync()
        assert caught.value.step == bad_step
        assert caught.value.odd_ranks == (1,)
        # recovered at once (auto_recover): an empty cache, in lockstep again
        assert coord.stats()["recoveries"] == 1
        assert coord.admit("c", list(range(1, 30))).prefix_len == 0
        coord.sync()
        assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2
    finally:
        coord.close()


def test_frontend_in_another_process_connects_by_name(ray_cluster):
    from tpcache.frontend.service import serve

    actor = serve(group_config(2), name="tp-test", namespace="tpcache-tests")
    try:
        address = ray_cluster.get_runtime_context().gcs_address
        script = textwrap.dedent(
            f"""
            import json, ray, tpcache.frontend.service as s
            ray.init(address={address!r}, log_to_driver=False)
            c = s.connect("tp-test", "tpcache-tests")
            a = c.admit("p1", list(range(1, 25)))
            c.finish("p1", [99, 98])
            b = c.admit("p2", list(range(1, 25)))
            try:
                c.finish("nobody")
                err = None
            except Exception as exc:
                err = type(exc).__name__
            c.finish("p2")
            c.sync()
            print(json.dumps({{"a": a.prefix_len, "b": b.prefix_len, "err": err,
                              "same": a.slots[:20] == b.slots[:20],
                              "stats": c.stats()["steps_done"]}}))
            """
        )
        env = dict(os.environ)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"a": 0, "b": 20, "err": "UnknownRequest", "same": True, "stats": 4}
        digests = ray_cluster.get(actor.rank_digests.remote())
        assert len(set(digests)) == 1
    finally:
        ray_cluster.get(actor.shutdown.remote())
        ray_cluster.kill(actor)
