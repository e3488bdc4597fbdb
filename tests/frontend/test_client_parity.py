"""The two clients, one per transport (``tpcache.client.NetworkClient`` over ZMQ,
``tpcache.RayClient`` through Ray), against one served group (TP=2 Ray ranks running
the reference model, its network frontend on IPC): every call returns the same record
type with the same fields and, for the same calls on cold prompts, the same values;
refusals raise the same typed errors."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import tpcache
from tpcache.cache.errors import UnknownRequest
from tpcache.client import NetworkClient
from tpcache.coordinator.build import GroupConfig
from tpcache.engine.requests import BadSampling
from tpcache.frontend import api
from tpcache.frontend.calls import TokenStream
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import ServeOptions, connect, serve, stop_served
from tpcache.workers.spec import CacheSpec

NS = "tpcache-tests"
MODEL = {"vocab": 64, "hidden": 32, "heads": 4, "head_dim": 8, "ffn": 64}


def every_call(c: Any, base: int) -> list[tuple[str, Any]]:
    """Each client call once, on prompts of tokens from ``base`` (a range no other run
    uses, so each client starts cold); ``(call, what it returned)`` in order."""
    prompt = list(range(base, base + 20))
    got: list[tuple[str, Any]] = [
        ("admit", c.admit("r", prompt)),
        ("extend", c.extend("r", 2)),
        ("cache_unfinished", c.cache_unfinished("r", [*prompt, base + 20, base + 21])),
        ("finish", c.finish("r", [base + 20, base + 21])),
        ("admit_hit", c.admit("s", prompt)),
        ("abort", c.abort("s")),
    ]
    with c.batch() as b:
        admitted = b.admit("t", [*prompt, 1])
        finished = b.finish("t")
    got += [("batch_admit", admitted.result()), ("batch_finish", finished.result())]
    got.append(("generate", c.generate([base, base + 1, base + 2], 5, ignore_eos=True)))
    stream = c.generate([base, base + 1, base + 2], 5, ignore_eos=True, stream=True)
    got.append(("stream", stream))
    got.append(("stream_tokens", list(stream)))
    got.append(("stream_result", stream.result))
    got.append(("cancel", c.cancel("never-started")))
    got.append(("stats", c.stats()))
    return got


def fields(value: Any) -> Any:
    """A record's type and field values; slot ids as a count (which slots a cache hands
    out depends on what ran before)."""
    if isinstance(value, msgspec.Struct):
        out = msgspec.structs.asdict(value)
        for name in ("slots", "swa_slots", "row", "freed"):
            if name in out:
                out[name] = len(out[name])
        return type(value).__name__, out
    return type(value).__name__


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    endpoint = f"ipc://{tmp_path_factory.mktemp('parity')}/net.sock"
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=512,
        cache=CacheSpec(page_size=4, max_request_tokens=64),
        cpu_budget_bytes=1 << 22,
        timeout_s=30.0,
        runner="tpcache.model.reference:ReferenceRunner",
        runner_args=MODEL,
    )
    options = ServeOptions(network=FrontendConfig(endpoint=endpoint), model_name="ref")
    actor = serve(cfg, "parity", NS, serving=options)
    try:
        yield endpoint
    finally:
        stop_served(actor, "parity", NS)


def test_both_clients_return_the_same_records_for_every_call(served) -> None:
    ray_client = connect("parity", NS)
    assert type(ray_client) is tpcache.RayClient
    with NetworkClient(served) as net:
        by_ray = every_call(ray_client, 1)
        by_net = every_call(net, 30)
    assert [call for call, _ in by_ray] == [call for call, _ in by_net]
    for (call, r), (_, n) in zip(by_ray, by_net, strict=True):
        assert type(r) is type(n), call
    got = dict(by_ray)
    assert isinstance(got["admit"], api.AdmitReply) and got["admit"].prefix_len == 0
    assert isinstance(got["extend"], api.SlotsReply) and len(got["extend"].slots) == 2
    assert isinstance(got["finish"], api.CachedReply)
    assert got["admit_hit"].prefix_len == 16  # pages of 4, and the last token is always computed
    assert got["abort"] is None and got["cancel"] is False
    assert isinstance(got["generate"], api.GeneratedReply)
    assert isinstance(got["stream"], TokenStream) and got["stream_tokens"] == got["generate"].tokens
    assert isinstance(got["stats"], dict)
    # Same values where the calls are the same on a cold cache: counts, lengths, reasons.
    same = ("admit", "extend", "cache_unfinished", "finish", "admit_hit", "batch_admit")
    for call in (*same, "batch_finish", "abort", "cancel"):
        assert fields(got[call]) == fields(dict(by_net)[call]), call
    for call in ("generate", "stream_result"):
        r, n = msgspec.structs.asdict(got[call]), msgspec.structs.asdict(dict(by_net)[call])
        del r["tokens"], n["tokens"]  # other prompts, other tokens
        assert r == n, call


def test_both_clients_raise_the_same_typed_errors(served) -> None:
    ray_client = connect("parity", NS)
    with NetworkClient(served) as net:
        for c in (ray_client, net):
            with pytest.raises(UnknownRequest, match=r"^no running request 'nobody'$"):
                c.finish("nobody")
            with pytest.raises(UnknownRequest):
                c.extend("nobody", 1)
            with pytest.raises(BadSampling, match="temperature"):
                c.generate([1, 2], 4, temperature=-1.0)
            with c.batch() as b:
                p = b.abort("nobody")
            with pytest.raises(UnknownRequest):
                p.result()
