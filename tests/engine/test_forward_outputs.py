"""What a batched forward sends back: logits from rank 0 only and only for the items
that ask, every item's argmax, and a check that every rank computed the same outputs
(each item's argmax, mean logit and peak) without shipping every rank's logits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MODEL, group_config

from tpcache.coordinator.local_ranks import start_local_group
from tpcache.coordinator.step_types import RankCallError
from tpcache.engine.forward import ModelEngine
from tpcache.engine.work import Compute
from tpcache.lockstep.ops import encode
from tpcache.model.context import ForwardError, build_forward_batch


def test_an_item_without_logits_gets_the_argmax_of_the_logits_it_would_have_had() -> None:
    coord = start_local_group(group_config())
    try:
        eng = ModelEngine(coord)
        prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [9, 8, 7, 6, 5, 4, 3]}
        for rid, p in prompts.items():
            coord.admit(rid, p)
        with_logits, without = eng.step(
            [Compute("a", prompts["a"], logits=True), Compute("b", prompts["b"], logits=False)]
        )
        assert with_logits.logits.shape == (1, MODEL.vocab)
        assert with_logits.argmax == int(np.argmax(with_logits.logits[-1]))
        assert without.logits.size == 0 and without.computed == 7
        # the same positions again, this time with their logits: the argmax matches
        coord.abort("b")
        coord.admit("b2", prompts["b"])
        again = eng.step([Compute("b2", prompts["b"])])[0]
        assert without.argmax == int(np.argmax(again.logits[-1]))
        for rid in ("a", "b2"):
            coord.abort(rid)
        coord.sync()
    finally:
        coord.close()


@pytest.mark.parametrize("skew", ["shift", "argmax"])
def test_a_rank_whose_outputs_differ_fails_the_forward(skew: str) -> None:
    args = {k: getattr(MODEL, k) for k in ("vocab", "hidden", "heads", "head_dim", "ffn")}
    args |= {"num_layers": MODEL.num_layers, "seed": MODEL.seed, "skew": skew}
    coord = start_local_group(group_config(runner="runner_doubles:SkewedOnRank1", runner_args=args))
    try:
        eng = ModelEngine(coord)
        coord.admit("x", [1, 2, 3, 4])
        with pytest.raises(ForwardError, match="rank 1's outputs differ from rank 0's"):
            eng.step([Compute("x", [1, 2, 3, 4], logits=False)])
    finally:
        coord.close()


def test_logits_flags_of_another_length_are_refused_before_anything_is_sent() -> None:
    coord = start_local_group(group_config())
    try:
        coord.admit("x", [1, 2, 3])
        with pytest.raises(ForwardError, match="2 logits flags for 1 items"):
            build_forward_batch(coord.mirror, [("x", [1, 2, 3])], logits=[True, False])
        coord.abort("x")
        coord.sync()
    finally:
        coord.close()


def test_a_refused_forward_names_the_rank(make_group) -> None:
    """Thread ranks agree by a collective: a token outside the vocabulary is refused on
    every rank, as a ``RankCallError`` whose cause is ForwardError."""
    coord = make_group()
    eng = ModelEngine(coord)
    coord.admit("x", [1, MODEL.vocab + 3])
    with pytest.raises(RankCallError) as err:
        eng.step([Compute("x", [1, MODEL.vocab + 3])])
    assert isinstance(err.value.cause, ForwardError)


def test_run_forward_without_a_batch_kept_for_this_step_computes_nothing() -> None:
    """``run_forward`` refuses, on every rank and before any collective, when no batch
    was prepared, or when a step was applied after the one its batch was checked at."""
    coord = start_local_group(group_config())
    try:
        forwards = [t["forwards"] for t in coord.ranks.call("model_times")]
        with pytest.raises(RankCallError, match="holds no forward prepared"):
            coord.ranks.call("run_forward")
        coord.admit("x", [1, 2, 3])
        coord.sync()
        cmd = encode(build_forward_batch(coord.mirror, [("x", [1, 2, 3])]))
        assert coord.ranks.call("prepare_forward", cmd) == [None, None]
        coord.admit("y", [4, 5])  # a step after the check: its slots may have changed
        coord.sync()
        with pytest.raises(RankCallError, match="holds no forward prepared"):
            coord.ranks.call("run_forward")
        assert [t["forwards"] for t in coord.ranks.call("model_times")] == forwards
        coord.abort("x")
        coord.abort("y")
        coord.sync()
    finally:
        coord.close()
