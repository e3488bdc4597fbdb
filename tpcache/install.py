"""What each install holds. The plain install (``pip install tpcache``) is what a router
host needs: the network client (``tpcache.client``), ``tpcache replay``, ``keys`` and
``events``, over numpy, msgspec and pyzmq alone. Serving a group, the engine, the Ray
client, ``demo`` and ``generate`` need the ``server`` extra (``pip install
'tpcache[server]'``: torch, Ray and the model readers).

A server command or the Ray client on a plain install says so in one line
(``MissingExtra``) instead of failing with an import traceback halfway through. Imports
only the standard library and ``errors``, so it works on every install.
"""

from __future__ import annotations

import importlib.util

from tpcache.errors import TpcacheError

SERVER_EXTRA = "server"
# The modules the server extra installs, by import name; pyproject.toml lists their
# distributions (a test checks the two agree).
SERVER_MODULES = ("torch", "ray", "safetensors", "tokenizers", "prometheus_client")
INSTALL_SERVER = f"pip install 'tpcache[{SERVER_EXTRA}]'"


class MissingExtra(TpcacheError, ImportError):
    """Something was asked of this install that only the server extra provides."""


def missing_server_modules() -> list[str]:
    """The server extra's modules this install cannot import, in ``SERVER_MODULES``
    order; empty when the extra is there. Finds them without importing them (cheap)."""
    return [name for name in SERVER_MODULES if not _importable(name)]


def require_server(what: str) -> None:
    """Raise ``MissingExtra`` naming ``what`` (e.g. ``"tpcache serve"``), the modules
    that are missing and the command that installs them, unless the server extra is
    installed. Changes nothing."""
    missing = missing_server_modules()
    if missing:
        raise MissingExtra(
            f"{what} needs the {SERVER_EXTRA} extra, which this install lacks "
            f"({', '.join(missing)} not installed): {INSTALL_SERVER}"
        )


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # ValueError: a module set to None in sys.modules (import of it is blocked).
        return False
