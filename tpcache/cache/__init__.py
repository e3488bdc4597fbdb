"""The cache state machine: pure, deterministic, single process.

Imports nothing else of tpcache (no Ray, no torch.distributed), so it can be tested,
benchmarked and reused alone.
"""

from tpcache.cache.errors import CacheError
from tpcache.cache.radix import (
    AdmitResult,
    CacheConfig,
    CacheSizes,
    EvictResult,
    Handle,
    MatchResult,
    RadixCache,
)

__all__ = [
    "AdmitResult",
    "CacheConfig",
    "CacheError",
    "CacheSizes",
    "EvictResult",
    "Handle",
    "MatchResult",
    "RadixCache",
]
