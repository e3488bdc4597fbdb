"""What every rank of one TP group is configured with: the cache it builds (``CacheSpec``,
the cache factory's spec: ``cache/factory.py``) and the rest of the rank (``WorkerSpec``).
Plain records, identical on every rank and in the coordinator's mirror.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcache.cache.factory import CacheSpec
from tpcache.errors import TpcacheError
from tpcache.group.spec import check_seconds
from tpcache.kv.pool import PoolSpec
from tpcache.model.runner_spec import RunnerSpec

__all__ = ["CacheSpec", "WorkerSpec", "WorkerSpecError"]


class WorkerSpecError(TpcacheError, ValueError):
    """A rank's spec (or its rank number) is invalid; the message names the field."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of one TP group is configured with (identical on every rank).

    ``timeout_s`` bounds each collective (how fast a hung rank is found);
    ``join_timeout_s`` bounds joining the group at start-up and after a recovery (how long
    a slow-starting rank may take). See ``GroupSpec``.
    """

    pool: PoolSpec
    cache: CacheSpec = field(default_factory=CacheSpec)
    capacity_tokens: int | None = None  # None: as many slots as the budget allows
    cpu_budget_bytes: int = 256 << 20
    gpu_fraction: float = 0.8
    backend: str = "auto"
    timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    # The model runner every rank builds and loads at construction (None: none until
    # load_model/load_runner); ``pool`` must then be the pool its layout asks for
    # (``runner_spec.runner_pool``).
    runner: RunnerSpec | None = None

    def __post_init__(self) -> None:
        if self.capacity_tokens is not None and self.capacity_tokens < self.cache.page_size:
            raise WorkerSpecError(
                f"capacity_tokens={self.capacity_tokens} is below one page of {self.cache.page_size}"
            )
        # Checked here as well as in GroupSpec: a bad value fails before any rank starts.
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("join_timeout_s", self.join_timeout_s)
