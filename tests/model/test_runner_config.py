"""Naming, building and fitting runners: every mistake is a typed error raised before any
rank starts (or, for a rank already running, with its runner kept)."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import LLAMA, RECORDING, base_cache, group_config, hybrid_cache

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.kv.pool import PoolSpec
from tpcache.model.reference import ModelConfigError, ModelSpec
from tpcache.model.runner import KVLayout, RunnerConfigError
from tpcache.model.runner_spec import (
    RunnerSpec,
    RunnerSpecError,
    build_runner,
    parse_runner_arg,
    runner_options,
    runner_pool,
)
from tpcache.workers.rank import RankWorker, WorkerSpec


def test_runner_options_parse_the_cli_flags_into_group_config_fields():
    got = runner_options(
        LLAMA,
        ["heads=8", "kv_heads=2", "swa_layers=[0, 2]", "eps=1e-6", "weights=/m/x", "tie_embeddings=true"],
    )  # fmt: skip
    assert got == {
        "runner": LLAMA,
        "runner_args": {
            "heads": 8,
            "kv_heads": 2,
            "swa_layers": [0, 2],
            "eps": 1e-6,
            "weights": "/m/x",
            "tie_embeddings": True,
        },
    }
    cfg = GroupConfig(tp=2, **got)
    assert cfg.runner_spec() == RunnerSpec.of(LLAMA, got["runner_args"])
    assert cfg.runner_spec().kwargs["swa_layers"] == (0, 2)  # hashable, comparable
    assert runner_options(None, []) == {} and runner_options(None, None) == {}
    assert parse_runner_arg("config=") == ("config", "")
    assert parse_runner_arg('name="7"') == ("name", "7")


@pytest.mark.parametrize(
    ("runner", "args", "match"),
    [
        (None, ["heads=8"], "needs a --runner"),
        (LLAMA, ["heads"], "name=value"),
        (LLAMA, ["=3"], "name=value"),
        (LLAMA, ["1x=3"], "name=value"),
        (LLAMA, ["a=1", "a=2"], "twice"),
        ("nocolon", [], r"package\.module:Class"),
        ("pkg.mod:", [], r"package\.module:Class"),
        (":Cls", [], r"package\.module:Class"),
        ("a b:C", [], r"package\.module:Class"),
        ("pkg.mod:C;rm", [], r"package\.module:Class"),
    ],
)
def test_runner_options_refuse_malformed_flags(runner, args, match):
    with pytest.raises(RunnerSpecError, match=match):
        runner_options(runner, args)


def test_group_config_refuses_a_bad_runner_before_anything_starts():
    with pytest.raises(RunnerSpecError, match=r"package\.module:Class"):
        GroupConfig(runner="nocolon")
    with pytest.raises(RunnerSpecError, match="need a runner"):
        GroupConfig(runner_args={"heads": 8})
    with pytest.raises(RunnerSpecError, match="mapping"):
        GroupConfig(runner=LLAMA, runner_args=["heads=8"])  # type: ignore[arg-type]
    bad = [
        ("tpcache.no_such_module:X", {}, "cannot import"),
        ("tpcache.model.reference:NoSuchRunner", {}, "has no"),
        ("tpcache.model.reference:ModelSpec", {}, "not a ModelRunner"),
        ("runner_doubles:NotARunner", {}, "no load, check_batch, run"),
        ("tpcache.model.reference:ReferenceRunner", {"bogus": 1}, "bogus"),
        (LLAMA, {"bogus": 1}, "unknown LlamaSpec arguments"),
        (LLAMA, {"dtype": "int8"}, "dtype"),
        (LLAMA, {"heads": 6, "kv_heads": 4}, "multiple of kv_heads"),
    ]
    for target, args, match in bad:
        cfg = GroupConfig(runner=target, runner_args=args)  # the name is well formed
        with pytest.raises(RunnerConfigError, match=match):
            cfg.worker_spec()
        with pytest.raises(RunnerConfigError, match=match):
            start_local_group(cfg)


def test_layouts_that_do_not_fit_tp_or_the_cache_are_refused():
    with pytest.raises(RunnerConfigError, match="kv_heads=3 does not divide by tp=2"):
        group_config(2, LLAMA, {"heads": 6, "kv_heads": 3}, base_cache(), 128).worker_spec()
    odd_ffn = group_config(4, LLAMA, {"kv_heads": 4, "heads": 4, "ffn": 66}, base_cache(), 128)
    assert odd_ffn.worker_spec().pool.kv_heads == 4  # the KV fits; the MLP does not split
    with pytest.raises(RunnerConfigError, match="ffn=66 must divide by tp=4"):
        start_local_group(odd_ffn)  # refused as the first rank loads its shard
    hybrid_model = {"num_layers": 2, "swa_layers": [1], "window": 4}
    with pytest.raises(RunnerConfigError, match="window is 4, the hybrid cache's 8"):
        group_config(2, RECORDING, hybrid_model, hybrid_cache(8), 128).worker_spec()
    every_layer_slides = {"num_layers": 2, "swa_layers": [0, 1], "window": 8}
    with pytest.raises(RunnerConfigError, match="full-attention layer"):
        group_config(2, RECORDING, every_layer_slides, hybrid_cache(8), 128).worker_spec()
    for kwargs, match in (
        ({"num_layers": 0}, "num_layers"),
        ({"kv_heads": True}, "kv_heads"),
        ({"swa_layers": (1, 0), "window": 2}, "swa_layers"),
        ({"swa_layers": (0,)}, "window"),
        ({"window": 3}, "window without"),
        ({"dtype": "float64"}, "dtype"),
    ):
        with pytest.raises(RunnerConfigError, match=match):
            KVLayout(**{"num_layers": 2, "kv_heads": 2, "head_dim": 4, **kwargs})


def test_a_rank_refuses_a_pool_its_runner_does_not_fit_and_keeps_its_runner():
    spec = RunnerSpec.of(RECORDING, {"head_dim": 8})
    assert runner_pool(spec, 2, None) == PoolSpec(2, 4, 8, 2, "float32")
    with pytest.raises(RunnerConfigError, match=r"needs a pool of 2 layers x 4 KV heads x 8"):
        RankWorker(0, WorkerSpec(pool=PoolSpec(2, 4, 4, 2), runner=spec))
    coord = start_local_group(group_config(2, RECORDING, {}, base_cache(), 64))
    try:
        w = coord.ranks.workers[0]
        runner = w.runner
        with pytest.raises(RunnerConfigError, match="needs a pool of 3 layers"):
            w.load_runner(RECORDING, {"num_layers": 3})
        with pytest.raises(ModelConfigError, match="needs a pool of 2 layers x 4 KV heads x 8"):
            w.load_model(ModelSpec())  # head_dim 8, the pool's is 4
        with pytest.raises(RunnerSpecError, match="cannot import"):
            w.load_runner("no_such_module:R")
        assert w.runner is runner
        assert w.load_runner(RECORDING, {"vocab": 10})["full_layers"] == 2
        assert w.runner is not runner and w.runner.vocab == 10
    finally:
        coord.close()


def test_build_runner_constructs_without_loading_weights():
    runner = build_runner(RunnerSpec.of(LLAMA, {"heads": 4, "kv_heads": 1}))
    assert runner.kv_layout() == KVLayout(2, 1, 8, "float32", replicate_kv=True)
    assert runner.w == {}  # load() is the rank's, not the coordinator's
    torch.manual_seed(0)  # building twice gives the same layout, whatever the global RNG
    assert (
        build_runner(RunnerSpec.of(LLAMA, {"heads": 4, "kv_heads": 1})).kv_layout()
        == runner.kv_layout()
    )
