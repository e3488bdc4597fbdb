"""Namespaced requests (#21) across TP ranks: Ray ranks in lockstep against one
in-process cache, the Ray-facing API and the network frontend's client passing the
namespace, and bad namespaces refused before anything is logged."""

from __future__ import annotations

import random
import threading

import pytest
from drill_worker import DrillWorker
from group_helpers import group_config
from test_netfront import group, settled

from tpcache.cache import errors
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.radix import RadixCache
from tpcache.client import Client
from tpcache.frontend import api
from tpcache.frontend.frontend import handle, serve_network
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import start_group

SPACES = [None, CacheNamespace(salt="t1"), CacheNamespace(lora_id=5, lora_name="ad", salt="t1")]


def namespaced_workload(seed: int, n: int = 150) -> list[tuple]:
    """Admits of a few shared prompts under random namespaces; finishes, aborts, chunks."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(8, 50))] for _ in range(8)]
    calls: list[tuple] = []
    running: dict[int, list[int]] = {}
    for rid in range(n):
        if rng.random() < 0.5 or not running:
            prompt = rng.choice(prompts) + [rng.randrange(1, 300) for _ in range(rng.randrange(20))]
            calls.append(("admit", rid, prompt, rng.randrange(len(SPACES))))
            running[rid] = prompt
            continue
        old = rng.choice(sorted(running))
        r = rng.random()
        if r < 0.6:
            calls.append(("finish", old, [rng.randrange(1, 300) for _ in range(2)]))
            calls[-1:0] = [("extend", old, 2)]
        elif r < 0.8:
            calls.append(("abort", old))
        else:
            calls.append(("cache_unfinished", old, running[old]))
            continue
        del running[old]
    calls += [("finish", rid, []) for rid in sorted(running)]
    return calls


def apply_call(target, call: tuple) -> tuple:
    kind, rid, *rest = call
    try:
        if kind == "admit":
            got = target.admit(rid, rest[0], namespace=SPACES[rest[1]])
            return ("admit", got.prefix_len, got.slots.tolist())
        if kind == "extend":
            return ("extend", target.extend(rid, rest[0]).tolist())
        if kind == "finish":
            return ("finish", target.finish(rid, rest[0]))
        if kind == "cache_unfinished":
            return ("cu", target.cache_unfinished(rid, rest[0]))
        target.abort(rid)
        return ("abort",)
    except errors.CacheError as exc:
        return ("error", type(exc).__name__)


def test_ray_ranks_with_namespaced_requests_stay_equal(ray_cluster) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    coord = start_group(group_config(2), worker_cls=DrillWorker)
    try:
        local = RadixCache(coord.mirror.config)
        for i, call in enumerate(namespaced_workload(seed)):
            want = apply_call(local, call)
            assert apply_call(coord, call) == want, f"call {i} {call[:2]}"
        coord.sync()
        assert local.tree.evicted_pages > 0 and local.tree.spaces
        assert coord.ranks.call("digest") == [local.digest()] * 2
        assert coord.stats()["divergences"] == 0
        coord.ranks.call("check_integrity")
        # The API's records: a salted admit misses what the default namespace cached.
        prompt = list(range(1, 40))
        for rid, salt in (("p", None), ("q", "other"), ("r", "other")):
            call = api.AdmitCall(rid, prompt, cache_salt=salt)
            reply = api.decode_reply(handle(coord, api.encode(call)))
            assert isinstance(reply, api.AdmitReply)
            handle(coord, api.encode(api.FinishCall(rid)))
            assert reply.prefix_len == (36 if rid == "r" else 0)  # "r" hits what "q" cached
        before = coord.mirror.digest()
        for bad, error in (
            (api.AdmitCall("x", prompt, lora_id=-1), "InvalidNamespace"),
            (api.AdmitCall("x", prompt, cache_salt=""), "InvalidNamespace"),
        ):
            reply = api.decode_reply(handle(coord, api.encode(bad)))
            assert isinstance(reply, api.ErrorReply) and reply.error == error, reply
        raw = api.encode(api.AdmitCall("x", prompt, cache_salt=7))  # type: ignore[arg-type]
        reply = api.decode_reply(handle(coord, raw))
        assert isinstance(reply, api.ErrorReply) and reply.error == "BadRequest"
        assert "cache_salt" in reply.message
        coord.sync()
        assert coord.mirror.digest() == before
        assert coord.ranks.call("digest") == [before] * 2
    finally:
        coord.close()


def test_the_network_client_passes_the_namespace() -> None:
    coord = group()
    lock = threading.Lock()
    front = serve_network(coord, FrontendConfig(endpoint="tcp://127.0.0.1:*"), lock)
    try:
        prompt = list(range(1, 30))
        with Client(front.endpoint) as c:
            assert c.admit("a", prompt, cache_salt="s1").prefix_len == 0
            c.finish("a")
            assert c.admit("b", prompt).prefix_len == 0  # the default namespace: a miss
            c.abort("b")
            with c.batch() as b:
                hit = b.admit("c", prompt, cache_salt="s1")
                lora = b.admit("d", prompt, lora_id=1, lora_name="x", cache_salt="s1")
            assert (hit.result().prefix_len, lora.result().prefix_len) == (28, 0)
            c.finish("c")
            c.finish("d")
            with pytest.raises(errors.InvalidNamespace, match="lora_id must be in"):
                c.admit("e", prompt, lora_id=-3)
            with pytest.raises(errors.InvalidNamespace, match="got 300"):
                c.admit("e", prompt, cache_salt="s" * 300)
            assert c.stats()["running"] == 0
        digest, ranks = settled(coord, lock)
        assert ranks == [digest, digest] and len(coord.mirror.tree.spaces) == 2
    finally:
        front.close()
        coord.close()
