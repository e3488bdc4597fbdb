"""A TP=2 group of in-process ranks running the reference model, its serving engine,
and the network frontend over both: what the network generate tests drive."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from drill_worker import DrillWorker

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import Coordinator
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.config import EngineConfig
from tpcache.engine.loop import Engine
from tpcache.frontend.frontend import serve_network
from tpcache.frontend.netfront import FrontendConfig, NetFrontend
from tpcache.workers.spec import CacheSpec

REFERENCE = "tpcache.model.reference:ReferenceRunner"
VOCAB = 64


@dataclass
class Served:
    coord: Coordinator
    engine: Engine
    front: NetFrontend
    lock: threading.Lock


def model_group(tp: int = 2, capacity: int = 512, max_request: int = 128) -> Coordinator:
    cfg = GroupConfig(
        tp=tp,
        capacity_tokens=capacity,
        cache=CacheSpec(page_size=4, max_request_tokens=max_request),
        cpu_budget_bytes=1 << 24,
        timeout_s=30.0,
        runner=REFERENCE,
        runner_args={"vocab": VOCAB, "hidden": 32, "heads": 4, "head_dim": 8, "ffn": 64},
    )
    return start_local_group(cfg, worker_cls=DrillWorker)


@contextlib.contextmanager
def served_model(
    capacity: int = 512, max_request: int = 128, max_batch: int = 8, max_queue: int = 4096
) -> Iterator[Served]:
    """The group, a started engine and the network frontend on a loopback port; all
    closed after (frontend first, so its streams are cancelled while the engine runs)."""
    coord = model_group(capacity=capacity, max_request=max_request)
    engine = Engine(coord, EngineConfig(step_tokens=256, max_batch=max_batch), vocab=VOCAB)
    engine.start()
    lock = threading.Lock()
    config = FrontendConfig(endpoint="tcp://127.0.0.1:*", max_queue=max_queue)
    front = serve_network(coord, config, lock, engine)
    try:
        yield Served(coord, engine, front, lock)
    finally:
        front.close()
        engine.close()
        coord.close()


def undisturbed(coord: Coordinator, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens for ``prompt`` from an engine of its own over ``coord`` (the
    reference the network's answers are compared with)."""
    import queue

    from tpcache.engine.requests import Finished, GenerateRequest, SamplingParams

    engine = Engine(coord, EngineConfig(step_tokens=256, max_batch=1), vocab=VOCAB)
    engine.start()
    got: queue.SimpleQueue = queue.SimpleQueue()
    try:
        engine.submit(
            GenerateRequest("ref", tuple(prompt), SamplingParams(n, ignore_eos=True)), got.put
        )
        while not isinstance(ev := got.get(timeout=60), Finished):
            pass
        return list(ev.tokens)
    finally:
        engine.close()
