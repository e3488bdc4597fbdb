"""``EngineConfig``: how the serving engine schedules its steps (frozen, checked on
construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpcache.cache.namespace import CacheNamespace
from tpcache.engine.errors import EngineConfigError


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EngineConfigError(f"engine config: {name} must be an int >= {low}, got {value!r}")


def _seconds(name: str, value: object) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise EngineConfigError(f"engine config: {name} must be seconds > 0, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """``step_tokens``: tokens one step computes (decodes count one each; prefill is cut
    into chunks to fill the rest). ``max_batch``: requests in one forward (and running at
    once). ``eos_token_ids``: the model's end-of-sequence ids (a request stops at one
    unless it sets ``ignore_eos``). ``timeout_s``: the wait for one forward.
    ``ordered_admission``: admit in submission order only once the cache holds all a
    request would match after the earlier ones, and only with room for its whole output
    (so prefill computed equals ``tpcache replay``'s prompt - matched, and nothing is
    preempted). ``recovery_wait_s``: how long live requests wait for a failed TP group to
    come back; ``max_recoveries``: how often one request is re-admitted after failures
    before it fails. ``prefix_cache`` False: nothing is cached (no chunk, prompt or
    output is offered for matching; requests end aborted), so every admission misses
    once the cache is empty. ``namespace``: the cache namespace of every request (a
    tenant's salt, a LoRA id)."""

    step_tokens: int = 2048
    max_batch: int = 64
    eos_token_ids: tuple[int, ...] = ()
    timeout_s: float = 120.0
    ordered_admission: bool = False
    recovery_wait_s: float = 120.0
    max_recoveries: int = 3
    prefix_cache: bool = True  # False: nothing is cached (requests end aborted)
    namespace: CacheNamespace | None = None  # every request's cache namespace

    def __post_init__(self) -> None:
        _int("step_tokens", self.step_tokens, 1)
        _int("max_batch", self.max_batch, 1)
        if not isinstance(self.eos_token_ids, tuple | list):
            raise EngineConfigError("engine config: eos_token_ids must be a list of token ids")
        for t in self.eos_token_ids:
            _int("an eos token id", t, 0)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        _seconds("timeout_s", self.timeout_s)
        _seconds("recovery_wait_s", self.recovery_wait_s)
        if not isinstance(self.ordered_admission, bool):
            raise EngineConfigError("engine config: ordered_admission must be True or False")
        _int("max_recoveries", self.max_recoveries, 0)
        if not isinstance(self.prefix_cache, bool):
            raise EngineConfigError("engine config: prefix_cache must be True or False")
        if self.namespace is not None and not isinstance(self.namespace, CacheNamespace):
            raise EngineConfigError("engine config: namespace must be a CacheNamespace or None")


__all__ = ["EngineConfig"]
