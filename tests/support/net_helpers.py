"""A small TP=2 group of in-process ranks for the network frontend's tests, and the
check that every rank's cache equals the coordinator's mirror once settled."""

from __future__ import annotations

from drill_worker import DrillWorker

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.workers.spec import CacheSpec


def group(capacity: int = 4096, window: int | None = None):
    cfg = GroupConfig(
        tp=2,
        capacity_tokens=capacity,
        cache=CacheSpec(page_size=4, max_request_tokens=1024, sliding_window=window),
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 22,
        timeout_s=20.0,
    )
    return start_local_group(cfg, worker_cls=DrillWorker)  # request_slots: a test's view


def settled(coord, lock) -> tuple[int, list[int]]:
    with lock:
        coord.sync()
        coord.mirror.check_integrity()
        return coord.mirror.digest(), coord.ranks.call("digest")
