"""tpcache: one prefix KV cache for a whole tensor-parallel group.

Imports flow one way: ``frontend, harness -> coordinator -> events -> workers -> cache
-> errors`` (docs/DESIGN.md's "Layout" says what each folder holds). ``cache`` imports
nothing else of tpcache but ``errors``, so it can be tested, benchmarked and reused alone.

One client per transport, with the same calls and the same reply records
(``tpcache.frontend.api``'s ``AdmitReply``, ``SlotsReply``, ``CachedReply``, ...):

- ``tpcache.NetworkClient`` (``tpcache.client``): over ZMQ to a group served with a
  network endpoint; needs only the plain install (no torch, no Ray);
- ``tpcache.RayClient`` (``frontend.ray_client``), returned by ``tpcache.connect(name,
  namespace, address=...)``: through the Ray cluster; needs the ``server`` extra.

Both are imported on first use, so ``import tpcache`` imports neither Ray nor torch.
Every exception tpcache raises is a ``tpcache.TpcacheError``.
"""

from typing import Any

from tpcache.errors import TpcacheError

# The one place the version is written: pyproject.toml reads it (setuptools' dynamic
# version), and `tpcache --version` prints it.
__version__ = "0.1.0"
__all__ = ["NetworkClient", "RayClient", "TpcacheError", "__version__", "connect"]


def __getattr__(name: str) -> Any:
    if name == "NetworkClient":
        from tpcache.client import NetworkClient

        return NetworkClient
    if name in ("RayClient", "connect"):
        from tpcache.install import require_server

        require_server(f"tpcache.{name}")  # one line, not Ray's import traceback
        from tpcache.frontend import ray_client

        return getattr(ray_client, name)
    raise AttributeError(f"module 'tpcache' has no attribute {name!r}")
