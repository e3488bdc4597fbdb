"""A frontend's client of a served coordinator, on the session's Ray cluster: the calls
the README names (``batch``, ``flush``, ``evict``, ``reset``) and the API's reply records;
``tpcache.connect`` and ``tpcache.RayClient`` at the package top without Ray or torch on
import; serving under a taken name, replacing and
stopping; a group that cannot start raising its own error, leaving no actor."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tpcache.cache.errors import CacheError, UnknownRequest
from tpcache.coordinator.build import GroupConfig
from tpcache.events.metrics import MetricsError
from tpcache.frontend import api
from tpcache.frontend.ray_client import NotServing
from tpcache.workers.spec import CacheSpec

NS = "tpcache-tests"


def config(**kw) -> GroupConfig:
    return GroupConfig(
        tp=2,
        capacity_tokens=1024,
        cache=CacheSpec(page_size=4, max_request_tokens=256),
        num_layers=1,
        kv_heads=2,
        head_dim=2,
        dtype="float32",
        cpu_budget_bytes=1 << 20,
        timeout_s=20.0,
        **kw,
    )


def test_connect_and_client_at_the_package_top_without_ray_or_torch_on_import() -> None:
    code = (
        "import sys, tpcache; print('ray' in sys.modules, 'torch' in sys.modules); "
        "from tpcache import connect, RayClient; "
        "from tpcache.frontend import ray_client, service; "
        "print(connect is ray_client.connect is service.connect, "
        "RayClient is ray_client.RayClient is service.RayClient)"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.stdout.split() == ["False", "False", "True", "True"], got.stderr
    import tpcache

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tpcache.nope  # noqa: B018


def test_the_client_offers_what_the_readme_says(ray_cluster) -> None:
    import tpcache
    from tpcache.frontend.service import find_served, serve, stop_served

    actor = serve(config(), "cli-client", NS)
    try:
        c = tpcache.connect("cli-client", NS)
        prompt = list(range(1, 41))
        a = c.admit("a", prompt)
        assert isinstance(a, api.AdmitReply) and (a.prefix_len, len(a.slots)) == (0, 40)
        assert not hasattr(a, "page_size")  # no page size of 1 with slot ids as "pages"
        done = c.finish("a", [7, 8])
        assert isinstance(done, api.CachedReply) and done.cached_tokens == 40
        c.flush()
        before = c.stats()["steps_sent"]
        with c.batch() as b:
            p1 = b.admit("b", [*prompt, 9])
            p2 = b.finish("nope")
            p3 = b.extend("b", 2)
            with pytest.raises(RuntimeError, match="has not been sent yet"):
                p1.result()
        c.flush()
        assert c.stats()["steps_sent"] - before == 1  # three calls, one step
        got = p1.result()  # what admit outside a batch returns: an AdmitReply
        assert isinstance(got, api.AdmitReply) and got.prefix_len == 40
        assert got.slots[:40] == a.slots  # the cached prefix's slots
        more = p3.result()
        assert isinstance(more, api.SlotsReply) and len(more.slots) == 2
        with pytest.raises(UnknownRequest, match=r"^no running request 'nope'$"):
            p2.result()  # refused alone: the others applied
        with pytest.raises(ZeroDivisionError), c.batch() as b:
            b.admit("never", prompt)
            1 / 0  # noqa: B018
        with pytest.raises(UnknownRequest):
            c.finish("never")  # a block that raised sent nothing
        c.finish("b")
        c.sync()
        assert c.evict(10**6) == 40 and c.stats()["evictable"] == 0
        with pytest.raises(CacheError, match="must be an int"):
            c.evict(-1)
        assert c.admit("c", prompt).prefix_len == 0  # evicted
        c.finish("c")
        c.admit("running", prompt)
        c.reset()
        assert c.admit("d", prompt).prefix_len == 0  # reset dropped the cache ...
        with pytest.raises(UnknownRequest):
            c.finish("running")  # ... and the running requests
        other = tpcache.connect("cli-client", NS)  # another client: its own request ids
        with pytest.raises(UnknownRequest, match=r"^no running request 'd'$"):
            other.finish("d")
        other.admit("d", [5, 6, 7])  # the same id, its own request
        other.abort("d")
        c.finish("d")
        digests = ray_cluster.get(actor.rank_digests.remote())
        assert len(set(digests)) == 1 and c.stats()["divergences"] == 0
    finally:
        stop_served(actor, "cli-client", NS)
    assert find_served("cli-client", NS) is None
    with pytest.raises(NotServing, match="no coordinator named 'cli-client' in namespace"):
        tpcache.connect("cli-client", NS)


def test_a_taken_name_is_said_and_a_group_that_cannot_start_raises_its_own_error(
    ray_cluster,
) -> None:
    from tpcache.frontend.service import AlreadyServing, find_served, serve, stop_served

    actor = serve(config(), "cli-taken", NS)
    try:
        with pytest.raises(AlreadyServing, match=r"'cli-taken' in namespace .* \(TP=2, capa"):
            serve(config(), "cli-taken", NS)
        assert ray_cluster.get(actor.stats.remote())["tp"] == 2  # the first one goes on
    finally:
        stop_served(actor, "cli-taken", NS)
    assert find_served("cli-taken", NS) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve(config(metrics_port=port), "cli-metrics", NS)
    assert find_served("cli-metrics", NS) is None  # no actor left behind
