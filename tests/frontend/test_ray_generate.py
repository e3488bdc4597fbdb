"""Generate through the Ray service (a served TP=2 group of Ray rank actors running the
reference model): whole and streamed answers equal the network frontend's from the same
actor, a closed stream is cancelled, typed refusals, and a group without a model."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tpcache.client import NetworkClient
from tpcache.coordinator.build import GroupConfig
from tpcache.engine.errors import RequestTooLarge
from tpcache.engine.requests import BadSampling
from tpcache.frontend import api
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import ServeOptions, connect, serve, stop_served
from tpcache.workers.spec import CacheSpec

NS = "tpcache-tests"
MODEL = {"vocab": 64, "hidden": 32, "heads": 4, "head_dim": 8, "ffn": 64}


def config(**kw) -> GroupConfig:
    return GroupConfig(
        tp=2,
        capacity_tokens=512,
        cache=CacheSpec(page_size=4, max_request_tokens=64),
        cpu_budget_bytes=1 << 22,
        timeout_s=30.0,
        **kw,
    )


def test_ray_generate_whole_streamed_and_cancelled(ray_cluster, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/gen.sock"
    options = ServeOptions(network=FrontendConfig(endpoint=endpoint), http_port=0, model_name="ref")
    cfg = config(runner="tpcache.model.reference:ReferenceRunner", runner_args=MODEL)
    actor = serve(cfg, "ray-gen", NS, serving=options)
    try:
        c = connect("ray-gen", NS)
        ends = c.endpoints()
        assert ends["network"] == endpoint and ends["http"].startswith("http://127.0.0.1:")
        whole = c.generate([5, 6, 7, 8], 10, ignore_eos=True)
        assert isinstance(whole, api.GeneratedReply) and whole.finish_reason == "length"
        assert (whole.prompt_tokens, len(whole.tokens)) == (4, 10)
        assert list(c.generate([5, 6, 7, 8], 10, ignore_eos=True, stream=True)) == whole.tokens
        with NetworkClient(endpoint) as net:  # the same engine over the network
            assert net.generate([5, 6, 7, 8], 10, ignore_eos=True).tokens == whole.tokens
        ask = {"model": "ref", "prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0}
        req = urllib.request.Request(
            ends["http"] + "/v1/completions",
            json.dumps(ask).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:  # and over HTTP
            assert json.load(r)["choices"][0]["token_ids"] == whole.tokens
        it = c.generate([1, 2, 3], 60, ignore_eos=True, stream=True, request_id="long")
        next(it)
        it.close()  # cancels
        with pytest.raises(BadSampling, match="temperature"):
            c.generate([1, 2], 4, temperature=-1.0)
        with pytest.raises(RequestTooLarge):
            c.generate(list(range(1, 50)), 30)
        deadline = time.monotonic() + 20
        while (st := c.stats())["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (st["running"], st["held"]) == (0, 0)
        assert c.cancel("long") is False  # ended
    finally:
        stop_served(actor, "ray-gen", NS)


def test_ray_generate_without_a_model(ray_cluster) -> None:
    cfg = config(num_layers=1, kv_heads=2, head_dim=2, dtype="float32")
    actor = serve(cfg, "ray-nomodel", NS)
    try:
        c = connect("ray-nomodel", NS)
        with pytest.raises(api.NoModel, match="serves no model"):
            c.generate([1, 2, 3], 4)
        assert c.cancel("x") is False
        assert c.admit("a", [1, 2, 3]).prefix_len == 0
    finally:
        stop_served(actor, "ray-nomodel", NS)
