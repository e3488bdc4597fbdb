"""A small TP group configuration for tests on CPU ranks (page 4, tiny KV pool)."""

from __future__ import annotations

from tpcache.frontend.service import GroupConfig
from tpcache.workers.rank import CacheSpec

PAGE = 4
CAPACITY = 640


def group_config(tp: int, **kw) -> GroupConfig:
    base = dict(
        tp=tp,
        capacity_tokens=CAPACITY,
        cache=CacheSpec(page_size=PAGE, policy="lru", max_request_tokens=256),
        num_layers=2,
        kv_heads=4,
        head_dim=4,
        dtype="float32",
        cpu_budget_bytes=1 << 24,
        timeout_s=20.0,
    )
    base.update(kw)
    return GroupConfig(**base)
