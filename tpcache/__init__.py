"""tpcache: one prefix KV cache for a whole tensor-parallel group.

Imports flow one way: ``frontend, harness -> coordinator -> events -> workers -> cache
-> errors`` (the README's "Layout" says what each folder holds). ``cache`` imports
nothing else of tpcache but ``errors``, so it can be tested, benchmarked and reused alone.

A frontend reaches a served coordinator with ``tpcache.connect(name, namespace,
address=...)``, which returns a ``tpcache.Client`` (``frontend.ray_client``). Both are
imported on first use, so ``import tpcache`` imports neither Ray nor torch. Every
exception tpcache raises is a ``tpcache.TpcacheError``.
"""

from typing import Any

from tpcache.errors import TpcacheError

__version__ = "0.1.0"
__all__ = ["Client", "TpcacheError", "connect"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "connect"):
        from tpcache.frontend import ray_client

        return getattr(ray_client, name)
    raise AttributeError(f"module 'tpcache' has no attribute {name!r}")
