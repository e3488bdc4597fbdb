"""Naming a runner so that any process can build it: ``"package.module:Class"`` and
keyword arguments of plain data (a Ray rank builds its runner in its own process).

``runner_options`` turns a runner's name and ``k=v`` arguments (``"module:Class"``,
``["k=v", ...]``) into ``GroupConfig`` fields; ``build_runner`` imports and constructs; ``runner_pool``
is the pool a runner's layout asks for. Every error is a ``RunnerSpecError`` raised
before any rank starts. ``tpcache serve --runner module:Class --runner-arg k=v`` serves
such a runner (``--model DIR`` is ``LlamaRunner`` with ``model=DIR``).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpcache.kv.pool import PoolSpec
from tpcache.model.runner import KVLayout, ModelRunner, RunnerConfigError

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class RunnerSpecError(RunnerConfigError):
    """A runner that cannot be named, imported or built as given."""


def _frozen(value: Any) -> Any:
    """Lists (from JSON or a caller) as tuples: a spec stays hashable and comparable."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True)
class RunnerSpec:
    """``target``: ``"package.module:Class"`` (a dotted attribute path after the colon);
    ``args``: the keyword arguments its constructor gets, as sorted (name, value) pairs
    of plain data (numbers, strings, bools, None, tuples)."""

    target: str
    args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not _TARGET.match(self.target):
            raise RunnerSpecError(f"a runner is named 'package.module:Class', got {self.target!r}")
        names = [name for name, _ in self.args]
        if any(not isinstance(n, str) or not n.isidentifier() for n in names):
            raise RunnerSpecError(f"runner argument names must be identifiers, got {names}")
        if len(set(names)) != len(names):
            raise RunnerSpecError(f"a runner argument is given twice: {names}")

    @classmethod
    def of(cls, target: str, args: Mapping[str, Any] | None = None) -> RunnerSpec:
        if args is not None and not isinstance(args, Mapping):
            raise RunnerSpecError(f"runner_args must be a mapping, got {type(args).__name__}")
        pairs = tuple(sorted((k, _frozen(v)) for k, v in (args or {}).items()))
        return cls(target, pairs)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)


def build_runner(spec: RunnerSpec) -> ModelRunner:
    """Import ``spec.target`` and construct it with ``spec.args``. Loads no weights (the
    constructor of a runner is cheap by contract). Raises RunnerSpecError for a module or
    attribute that is missing, arguments it refuses, or an object that is not a
    ``ModelRunner`` with a ``KVLayout``; a RunnerConfigError of its own passes through."""
    module_name, _, attr = spec.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise RunnerSpecError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RunnerSpecError(f"{spec.target!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RunnerSpecError(f"{spec.target!r} is not callable")
    try:
        runner = obj(**spec.kwargs)
    except RunnerConfigError:
        raise
    except Exception as exc:
        raise RunnerSpecError(
            f"{spec.target}({_show(spec.kwargs)}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(runner, ModelRunner):
        missing = [m for m in ("kv_layout", "load", "check_batch", "run") if not hasattr(runner, m)]
        raise RunnerSpecError(f"{spec.target!r} is not a ModelRunner (no {', '.join(missing)})")
    layout = runner.kv_layout()
    if not isinstance(layout, KVLayout):
        raise RunnerSpecError(f"{spec.target}.kv_layout() gave {type(layout).__name__}")
    return runner


def runner_pool(spec: RunnerSpec, tp: int, window: int | None) -> PoolSpec:
    """The full pool ``spec``'s runner needs in a TP group of ``tp`` whose cache has the
    sliding ``window`` (None: none). Builds the runner (no weights) to ask its layout.
    Raises RunnerSpecError / RunnerConfigError (heads that do not divide by tp, a window
    that differs from the model's)."""
    return build_runner(spec).kv_layout().pool_spec(tp, window)


def parse_runner_arg(text: str) -> tuple[str, Any]:
    """``"name=value"``: the value as JSON when it parses (``4``, ``1e-5``, ``true``,
    ``null``, ``[0, 2]``, ``"quoted"``), else the text itself (``path/to/w.safetensors``).
    Raises RunnerSpecError for text without ``=`` or a name that is not an identifier."""
    name, eq, raw = text.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
        raise RunnerSpecError(f"a runner argument is name=value, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name, value


def runner_options(runner: str | None, runner_args: Sequence[str] | None = None) -> dict:
    """The ``GroupConfig`` fields for ``--runner module:Class --runner-arg k=v ...``:
    ``GroupConfig(**runner_options(a.runner, a.runner_arg), ...)``. No runner and no
    arguments: ``{}`` (the built-in pool). Checks the syntax only (imports nothing).
    Raises RunnerSpecError for arguments without a runner, a malformed ``k=v``, a name
    given twice, or a malformed target."""
    pairs = [parse_runner_arg(t) for t in runner_args or ()]
    if runner is None:
        if pairs:
            raise RunnerSpecError("--runner-arg needs a --runner")
        return {}
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise RunnerSpecError(f"a runner argument is given twice: {names}")
    RunnerSpec.of(runner, dict(pairs))  # the target's syntax, before anything starts
    return {"runner": runner, "runner_args": dict(pairs)}


def _show(kwargs: Mapping[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return text if len(text) <= 200 else text[:197] + "..."


__all__ = [
    "RunnerSpec",
    "RunnerSpecError",
    "build_runner",
    "parse_runner_arg",
    "runner_options",
    "runner_pool",
]
