"""tpcache: one prefix KV cache for a whole tensor-parallel group.

Imports flow one way: ``coordinator -> workers -> cache``. ``cache`` imports nothing
else of tpcache, so it can be tested, benchmarked and reused alone.
"""

__version__ = "0.1.0"
