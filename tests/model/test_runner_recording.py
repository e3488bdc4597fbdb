"""A runner other than the built-in one (``runner_doubles.RecordingRunner``) gets exactly
the slots the cache assigned, in step order, on every rank; and bad input to the forward
path is refused with a typed error, nothing changed. TP=2, ranks as threads over gloo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runner_doubles import Seen
from runner_helpers import RECORDING, base_cache, hybrid_cache, runner_engine

from tpcache.cache.errors import DuplicateRequest, InvalidTokens, UnknownRequest
from tpcache.cache.keys import pages_to_slots
from tpcache.coordinator.step_types import RankCallError
from tpcache.engine.forward import Chunk, Compute, Decode, ModelEngine, Prefill
from tpcache.lockstep.ops import Forward, ForwardBatch, encode
from tpcache.model.context import ForwardError, build_forward

HYBRID_ARGS = {"num_layers": 3, "swa_layers": [0, 2], "window": 8}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def row(eng: ModelEngine, rid: str) -> list[int]:
    r = eng.coord.mirror.request_row(rid)
    return pages_to_slots(r.pages, eng.coord.mirror.page_size, r.num_tokens).tolist()


def expect(eng: ModelEngine, rid: str, tokens: list[int], write: list[int]) -> Seen:
    """What the runner must get for ``rid``: its newest ``tokens`` written at ``write``
    (the slots the cache's admit/extend reply gave), its whole row read (the mirror's)."""
    slots = row(eng, rid)
    start = len(slots) - len(tokens)
    assert slots[start:] == write  # the reply's slots are the row's newest
    swa_start, swa = 0, None
    mirror = eng.coord.mirror
    if mirror.swa is not None:
        swa_start = max(0, start - mirror.swa.window)
        swa = mirror.swa.slots(np.asarray(slots[swa_start:])).tolist()
    return Seen(rid, tokens, start, write, slots, swa_start, swa, False)


def last_step(eng: ModelEngine) -> int:
    return eng.coord.stats()["steps_sent"] - 1


@pytest.mark.parametrize("kind", ["base", "hybrid"])
def test_a_runner_gets_the_slots_the_cache_assigned_in_step_order_on_every_rank(kind):
    hybrid = kind == "hybrid"
    cache = hybrid_cache(8) if hybrid else base_cache()
    eng = runner_engine(2, RECORDING, HYBRID_ARGS if hybrid else {}, cache, 256)
    coord, want = eng.coord, []
    try:
        a, b = list(range(1, 11)), list(range(20, 30))
        got_a, got_b = coord.admit("a", a), coord.admit("b", b[:6])
        exp = [
            expect(eng, "a", a, got_a.slots.tolist()),
            expect(eng, "b", b[:6], got_b.slots.tolist()),
        ]
        outs = eng.step([Compute("a", a), Compute("b", b[:6])])
        want.append((last_step(eng), exp))
        assert [o.token for o in outs] == [11, 26] and [o.logits.shape for o in outs] == [
            (0, 0)
        ] * 2
        new_a = coord.extend("a", 1).slots.tolist()
        coord.cache_unfinished("b", b[:6])
        new_b = coord.extend("b", 4).slots.tolist()
        exp = [expect(eng, "a", [7], new_a), expect(eng, "b", b[6:], new_b)]
        eng.step([Compute("a", [7]), Compute("b", b[6:])])
        want.append((last_step(eng), exp))
        coord.finish("a", [7, 8])
        c = [*a, 7, 3, 3]
        got_c = coord.admit("c", c)
        assert got_c.prefix_len == 8 and got_c.slots[:8].tolist() == got_a.slots[:8].tolist()
        new_b = coord.extend("b", 1).slots.tolist()
        exp = [expect(eng, "c", c[8:], got_c.slots[8:].tolist()), expect(eng, "b", [9], new_b)]
        eng.step([Compute("c", c[8:]), Compute("b", [9])])
        want.append((last_step(eng), exp))
        # the engine's own cache calls: a decode and a prefill in one step
        outs = eng.step([Decode("b", 4), Prefill("d", [40, 41, 42])])
        exp = [
            expect(eng, "b", [4], row(eng, "b")[-1:]),
            expect(eng, "d", [40, 41, 42], row(eng, "d")),
        ]
        want.append((last_step(eng), exp))
        assert [o.prefix_len for o in outs] == [0, 0] and [o.token for o in outs] == [5, 43]
        workers = coord.ranks.workers
        for w in workers:
            assert w.runner.batches == want
            assert w.runner.all_reduced == [3.0] * len(want)  # ranks 1 + 2, every batch
            assert w.runner.shard.tp == 2 and w.runner.shard.rank == w.rank
        # the K the runner wrote where the cache said, read back: c's first 8 slots are
        # a's (the hit) and hold a's tokens, the rest c's own (every rank)
        for w in workers:
            k, v = w.read_kv(0, got_c.slots)
            assert k[:, 0, 0].tolist() == c and (v == -k).all()
        coord.sync()
        assert coord.ranks.call("digest") == [coord.mirror.digest()] * 2
    finally:
        coord.close()


def snapshot(eng: ModelEngine) -> tuple:
    coord = eng.coord
    coord.sync()
    ranks = coord.ranks.workers
    rows = {rid: row(eng, rid) for rid in coord.mirror.running_ids()}
    return (
        coord.mirror.digest(),
        coord.stats()["steps_sent"],
        rows,
        [len(w.runner.batches) for w in ranks],
        [w.tokens_computed for w in ranks],
        eng.counters.forwards,
    )


def test_bad_batches_are_refused_with_typed_errors_and_change_nothing():
    eng = runner_engine(2, RECORDING, {}, base_cache(), 128)
    coord = eng.coord
    try:
        eng.step([Prefill("x", [1, 2, 3, 4, 5]), Prefill("y", [6, 7])])
        before = snapshot(eng)
        cases = [
            ([Compute("nobody", [1])], UnknownRequest),
            ([Decode("nobody", 1)], UnknownRequest),
            ([Prefill("x", [1, 2])], DuplicateRequest),
            ([Compute("x", list(range(9)))], ForwardError),  # more tokens than slots
            ([Decode("x", 1), Decode("x", 2)], ForwardError),  # one request twice
            ([Decode("y", 1), Chunk("x", [], [1])], InvalidTokens),  # bad done, y not extended
            ([Decode("y", 1), Compute("x", [])], InvalidTokens),
            ([Decode("y", -3)], InvalidTokens),
            ([], ForwardError),
            (["x"], ForwardError),
        ]
        for work, err in cases:
            with pytest.raises(err):
                eng.step(work)  # type: ignore[arg-type]
            assert snapshot(eng) == before, work
        # commands the coordinator would never send reach the ranks: refused by every
        # rank before any compute, and the group goes on
        mirror = coord.mirror
        good = build_forward(mirror, "x", [4, 5], all_logits=False)
        for bad in (
            ForwardBatch([good, good]),
            ForwardBatch([]),
            ForwardBatch(
                [build_forward(mirror, "y", [7]), Forward("z", good.tokens, 3, good.slots)]
            ),
        ):
            with pytest.raises(RankCallError) as exc:
                coord.ranks.call("forward_batch", encode(bad))
            assert isinstance(exc.value.cause, ForwardError) and "refused" in str(exc.value.cause)
            assert snapshot(eng) == before
        # token ids the runner refuses (vocab 50): refused on every rank, nothing computed
        coord.admit("big", [1, 99])
        with pytest.raises(RankCallError, match="vocab 50"):
            eng.step([Compute("big", [1, 99])])
        assert [len(w.runner.batches) for w in coord.ranks.workers] == before[3]
        out = eng.step([Decode("x", 6), Decode("y", 8)])  # the group goes on
        assert [o.token for o in out] == [7, 9]
    finally:
        coord.close()
