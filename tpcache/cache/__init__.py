"""The cache state machine: pure, deterministic, single process.

Imports nothing else of tpcache (no Ray, no torch.distributed), so it can be tested,
benchmarked and reused alone. Upper layers ask a cache through ``Cache``
(``protocol.py``), which every kind implements: ``RadixCache`` (one pool),
``HybridCache`` (full and sliding-window pools) and ``HostCache`` (one pool and a host
tier), all built by ``factory.py``. The sliding window and the host tier are parts a
cache is built with (``cache.swa``, ``cache.host``: ``parts.py``), ``None`` without.
Their records are in ``records.py``, ``swa/config.py`` and ``host/config.py``.
"""

from tpcache.cache.errors import CacheError
from tpcache.cache.protocol import Cache
from tpcache.cache.radix import CacheConfig, RadixCache
from tpcache.cache.swa.cache import HybridCache
from tpcache.cache.swa.config import HybridConfig

__all__ = ["Cache", "CacheConfig", "CacheError", "HybridCache", "HybridConfig", "RadixCache"]
