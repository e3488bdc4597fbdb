"""One exception root: every exception class tpcache defines is a ``TpcacheError``, and
keeps the builtin base its callers catch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import tpcache
from tpcache.cache.errors import UnknownRequest
from tpcache.errors import TpcacheError


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(tpcache.__path__, "tpcache."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
    return found


def test_every_tpcache_exception_is_a_tpcache_error() -> None:
    classes = _exception_classes()
    assert len(classes) > 40  # the walk found the modules
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, TpcacheError)
    ]
    assert outside == []


def test_the_root_is_at_the_package_top_and_bases_stay() -> None:
    assert tpcache.TpcacheError is TpcacheError
    assert issubclass(UnknownRequest, KeyError)
    with_value_error = [c for c in _exception_classes() if issubclass(c, ValueError)]
    assert len(with_value_error) > 10


def test_the_client_and_the_root_import_without_torch_or_ray() -> None:
    code = (
        "import sys, tpcache.client, tpcache.errors; "
        "print('torch' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
