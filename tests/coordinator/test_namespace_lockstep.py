"""Namespaced requests across TP ranks: Ray ranks in lockstep against one
in-process cache, the Ray-facing API and the network frontend's client passing the
namespace, and bad namespaces refused before anything is logged."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from drill_worker import DrillWorker
from group_helpers import group_config
from net_helpers import group, settled
from test_lockstep_ray import apply_call

from tpcache.cache import errors
from tpcache.cache.namespace import CacheNamespace
from tpcache.cache.radix import RadixCache
from tpcache.client import NetworkClient
from tpcache.frontend import api
from tpcache.frontend.frontend import handle, serve_network
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import start_group

SPACES = [None, CacheNamespace(salt="t1"), CacheNamespace(lora_id=5, lora_name="ad", salt="t1")]


def namespaced_workload(seed: int, n: int = 150) -> tuple[list[tuple], dict[int, int]]:
    """Admits of a few shared prompts, finishes, aborts and chunks, as
    ``test_lockstep_ray.apply_call`` takes them; and each request's index in ``SPACES``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(8, 50))] for _ in range(8)]
    calls: list[tuple] = []
    spaces: dict[int, int] = {}
    running: dict[int, list[int]] = {}
    for rid in range(n):
        if rng.random() < 0.5 or not running:
            prompt = rng.choice(prompts) + [rng.randrange(1, 300) for _ in range(rng.randrange(20))]
            calls.append(("admit", rid, prompt, 0))
            spaces[rid] = rng.randrange(len(SPACES))
            running[rid] = prompt
            continue
        old = rng.choice(sorted(running))
        r = rng.random()
        if r < 0.6:
            calls += [
                ("extend", old, 2),
                ("finish", old, [rng.randrange(1, 300) for _ in range(2)]),
            ]
        elif r < 0.8:
            calls.append(("abort", old))
        else:
            calls.append(("cache_unfinished", old, running[old]))
            continue
        del running[old]
    calls += [("finish", rid, []) for rid in sorted(running)]
    return calls, spaces


class InSpace:
    """``target`` (a cache or a coordinator) whose admits go to each request's namespace."""

    def __init__(self, target: Any, spaces: dict[int, int]) -> None:
        self.target, self.spaces = target, spaces

    def admit(self, rid: int, tokens: list[int], reserve: int = 0) -> Any:
        return self.target.admit(rid, tokens, reserve=reserve, namespace=SPACES[self.spaces[rid]])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


def test_ray_ranks_with_namespaced_requests_stay_equal(ray_cluster) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    coord = start_group(group_config(2), worker_cls=DrillWorker)
    try:
        local = RadixCache(coord.mirror.config)
        calls, spaces = namespaced_workload(seed)
        for i, call in enumerate(calls):
            want = apply_call(InSpace(local, spaces), call)
            assert apply_call(InSpace(coord, spaces), call) == want, f"call {i} {call[:2]}"
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
        with NetworkClient(front.endpoint) as c:
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
            assert coord.stats()["running"] == 0
        digest, ranks = settled(coord, lock)
        assert ranks == [digest, digest] and len(coord.mirror.tree.spaces) == 2
    finally:
        front.close()
        coord.close()
