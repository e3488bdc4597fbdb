"""A rank SIGKILLed while streamed greedy generation runs over the network frontend (a
served TP=2 group of Ray rank actors running the reference model): the group recovers,
the engine re-runs its requests, and every stream completes with the tokens of an
undisturbed run of the same streams."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

from tpcache.client import NetworkClient
from tpcache.coordinator.build import GroupConfig
from tpcache.frontend.netfront import FrontendConfig
from tpcache.frontend.service import ServeOptions, serve, stop_served
from tpcache.workers.spec import CacheSpec

NS = "tpcache-tests"
MODEL = {"vocab": 64, "hidden": 32, "heads": 4, "head_dim": 8, "ffn": 64}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [3, 5, 8, 9, 7, 9], [2, 3, 8]]
NEW = 100


def _streams(endpoint: str, kill=None) -> tuple[list[list[int]], list[int]]:
    """Every prompt streamed at once, each from a client of its own thread; ``kill``
    runs once every stream has 3 tokens. The tokens, and how many each had then."""
    got: list[list[int]] = [[] for _ in PROMPTS]
    errors: list[BaseException] = []
    at_kill: list[int] = []

    def one(i: int) -> None:
        try:
            with NetworkClient(endpoint, timeout_s=120) as c:
                for t in c.generate(PROMPTS[i], NEW, ignore_eos=True, stream=True):
                    got[i].append(t)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    if kill is not None:
        deadline = time.monotonic() + 60
        while min(len(g) for g in got) < 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.005)
        at_kill = [len(g) for g in got]
        kill()
    for t in threads:
        t.join(240)
    assert not errors, errors
    return got, at_kill


def test_streams_survive_a_rank_killed_mid_generation(ray_cluster) -> None:
    import ray

    root = tempfile.mkdtemp(prefix="tpf", dir="/tmp")  # short: an IPC path
    endpoint = f"ipc://{root}/gen.sock"
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=1024,
        cache=CacheSpec(page_size=4, max_request_tokens=128),
        cpu_budget_bytes=1 << 22,
        timeout_s=10.0,
        join_timeout_s=90.0,
        runner="tpcache.model.reference:ReferenceRunner",
        runner_args=MODEL,
    )
    actor = serve(cfg, "gen-fault", NS, serving=ServeOptions(network=FrontendConfig(endpoint)))
    try:
        want, _ = _streams(endpoint)
        assert [len(w) for w in want] == [NEW] * len(PROMPTS)
        pids = ray.get(actor.rank_pids.remote())
        got, at_kill = _streams(endpoint, lambda: os.kill(pids[1], signal.SIGKILL))
        print(f"tokens per stream when rank 1 (pid {pids[1]}) was killed: {at_kill}")
        assert min(at_kill) >= 3 and max(at_kill) < NEW  # it died mid-generation
        assert got == want
        st = ray.get(actor.stats.remote())
        assert st["recoveries"] >= 1 and (st["running"], st["held"]) == (0, 0)
        assert pids[1] not in ray.get(actor.rank_pids.remote())
    finally:
        stop_served(actor, "gen-fault", NS)
        shutil.rmtree(root, ignore_errors=True)
