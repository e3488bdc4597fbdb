"""What the engine tests share: a tiny reference model on thread ranks (a real gloo
group), a sink that collects events, and the model's own greedy continuation computed
without any cache (``reference_logits``) as the oracle."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import pytest

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import Coordinator, CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.requests import Failed, Finished, GenEvent, TokenOut
from tpcache.model.reference import ModelSpec, reference_logits
from tpcache.workers.spec import CacheSpec

PAGE = 4
MODEL = ModelSpec(vocab=64, hidden=32, heads=4, head_dim=8, ffn=64, num_layers=2, seed=5)
RUNNER = "tpcache.model.reference:ReferenceRunner"


def group_config(capacity: int = 512, limit: int = 256, **kw) -> GroupConfig:
    base = dict(
        tp=2,
        capacity_tokens=capacity,
        cache=CacheSpec(page_size=PAGE, max_request_tokens=limit),
        dtype="float32",
        cpu_budget_bytes=1 << 24,
        timeout_s=20.0,
        runner=RUNNER,
        runner_args={
            k: getattr(MODEL, k)
            for k in ("vocab", "hidden", "heads", "head_dim", "ffn", "num_layers", "seed")
        },
        coordinator=CoordinatorConfig(auto_recover=False),
    )
    base.update(kw)
    return GroupConfig(**base)


@pytest.fixture
def make_group():
    """``make(capacity, limit)``: a started thread-rank group, closed after the test."""
    made: list[Coordinator] = []

    def make(capacity: int = 512, limit: int = 256) -> Coordinator:
        coord = start_local_group(group_config(capacity, limit))
        made.append(coord)
        return coord

    yield make
    for coord in made:
        coord.close()


class Collector:
    """A sink for many requests: every event per request, and a wait for their ends."""

    def __init__(self) -> None:
        self.events: dict[str | int, list[GenEvent]] = {}
        self.cv = threading.Condition()

    def __call__(self, ev: GenEvent) -> None:
        with self.cv:
            self.events.setdefault(ev.rid, []).append(ev)
            self.cv.notify_all()

    def ended(self, rid: str | int) -> bool:
        evs = self.events.get(rid, [])
        return bool(evs) and isinstance(evs[-1], Finished | Failed)

    def wait(self, rids: Iterable[str | int], timeout: float = 60.0) -> dict[str | int, GenEvent]:
        rids = list(rids)
        with self.cv:
            ok = self.cv.wait_for(lambda: all(self.ended(r) for r in rids), timeout)
        assert ok, f"not ended within {timeout}s: {[r for r in rids if not self.ended(r)]}"
        return {r: self.events[r][-1] for r in rids}

    def tokens(self, rid: str | int) -> list[int]:
        """The streamed tokens; checks each index came once, in order."""
        outs = [e for e in self.events[rid] if isinstance(e, TokenOut)]
        assert [e.index for e in outs] == list(range(len(outs))), outs
        return [e.token for e in outs]


def greedy_reference(prompt: Iterable[int], n: int, stop: Iterable[int] = ()) -> list[int]:
    """The model's greedy continuation, recomputed from scratch for every token."""
    toks, out, stop = list(prompt), [], set(stop)
    for _ in range(n):
        t = int(np.argmax(reference_logits(MODEL, toks + out)[-1].numpy()))
        out.append(t)
        if t in stop:
            break
    return out


def prompts(seed: int, count: int, length: int, shared: int = 0) -> list[tuple[int, ...]]:
    """``count`` random prompts of ``length`` tokens, the first ``shared`` common."""
    print(f"prompt seed {seed}")
    rng = np.random.default_rng(seed)
    stem = [int(x) for x in rng.integers(0, MODEL.vocab, shared)]
    return [
        tuple(stem + [int(x) for x in rng.integers(0, MODEL.vocab, length - shared)])
        for _ in range(count)
    ]


def nothing_held(coord: Coordinator) -> None:
    """No request running in the coordinator, every slot free or cached, ranks agree."""
    coord.sync()
    assert coord.stats()["running"] == 0
    assert coord.mirror.running_ids() == []
    sizes = coord.mirror.sizes()
    assert sizes.held == 0 and sizes.free + sizes.evictable + sizes.protected == sizes.capacity
    assert coord.ranks.call("digest") == [coord.mirror.digest()] * coord.ranks.world_size
