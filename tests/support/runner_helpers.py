"""TP groups whose ranks run a named model runner: threads of this process over a real
gloo group (``local_ranks.start_local_group``), driven by a ``ModelEngine``."""

from __future__ import annotations

import dataclasses
from typing import Any

from drill_worker import DrillWorker

from tpcache.coordinator.build import GroupConfig
from tpcache.coordinator.core import CoordinatorConfig
from tpcache.coordinator.local_ranks import start_local_group
from tpcache.engine.forward import ModelEngine
from tpcache.model.llama import LlamaReference, LlamaSpec
from tpcache.model.reference import ModelSpec
from tpcache.workers.rank import CacheSpec

REFERENCE = "tpcache.model.reference:ReferenceRunner"
LLAMA = "tpcache.model.llama:LlamaRunner"
RECORDING = "runner_doubles:RecordingRunner"

_NO_RECOVERY = (
    {"auto_recover": False} if "auto_recover" in CoordinatorConfig.__dataclass_fields__ else {}
)


def base_cache() -> CacheSpec:
    return CacheSpec(page_size=4, max_request_tokens=64)


def hybrid_cache(window: int = 8) -> CacheSpec:
    return CacheSpec(
        page_size=4, max_request_tokens=64, sliding_window=window, swa_capacity_tokens=80
    )


def group_config(
    tp: int, runner: str, args: dict[str, Any], cache: CacheSpec, capacity: int
) -> GroupConfig:
    return GroupConfig(
        tp=tp,
        capacity_tokens=capacity,
        cache=cache,
        cpu_budget_bytes=1 << 24,
        timeout_s=60.0,
        runner=runner,
        runner_args=args,
        coordinator=CoordinatorConfig(**_NO_RECOVERY),
    )


def runner_engine(
    tp: int, runner: str, args: dict[str, Any], cache: CacheSpec, capacity: int
) -> ModelEngine:
    """An engine over ``tp`` rank threads (gloo) whose ranks built ``runner(**args)``
    (test workers: ``read_kv`` reads what the runner wrote)."""
    config = group_config(tp, runner, args, cache, capacity)
    return ModelEngine(start_local_group(config, worker_cls=DrillWorker))


def reference_of(runner: str, args: dict[str, Any]):
    """What ``modelcheck`` compares the runner against (full recompute, no cache)."""
    fields = {k: v for k, v in args.items() if k != "dtype"}
    if runner == REFERENCE:
        if "swa_layers" in fields:
            fields["swa_layers"] = tuple(fields["swa_layers"])
        return ModelSpec(**fields)
    return LlamaReference(LlamaSpec.from_args(**fields))


def model_args(spec: ModelSpec) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()}
