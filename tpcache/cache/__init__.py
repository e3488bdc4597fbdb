"""The cache state machine: pure, deterministic, single process.

Imports nothing else of tpcache (no Ray, no torch.distributed), so it can be tested,
benchmarked and reused alone. Upper layers ask a cache through ``Cache``
(``protocol.py``), which both kinds implement: ``RadixCache`` (one pool) and
``HybridCache`` (full and sliding-window pools). Their records are in ``records.py``
and ``swa_config.py``.
"""

from tpcache.cache.errors import CacheError
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

__all__ = ["Cache", "CacheConfig", "CacheError", "HybridCache", "HybridConfig", "RadixCache"]
