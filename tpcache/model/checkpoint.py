"""Safetensors checkpoints through the ``safetensors`` package: one file, a directory of
them, or a sharded one with ``model.safetensors.index.json``.

``scan`` reads only the headers (names, shapes, dtypes); the package refuses a file whose
header does not describe its bytes (truncated, or malformed), and the scan does this for
every file before any tensor is read, so a runner's ``load`` (not a collective) fails
whole, on every rank alike, before a forward starts. ``check_tensors`` compares what is
there with what the model needs; ``read_tensors`` reads each tensor's wanted rows or
columns only (``get_slice``), one open per file.

Corruption inside a tensor's bytes (same length, other values) is not detectable: the
format has no checksum.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tpcache.model.errors import (
    MissingTensor,
    TensorDtypeError,
    TensorShapeError,
    UnexpectedTensor,
    UnreadableCheckpoint,
)

INDEX = "model.safetensors.index.json"
DTYPES = ("F32", "F16", "BF16")  # what the runner computes from

# rows, cols (None: all); a 1-D tensor uses rows only
Slice = tuple[slice | None, slice | None]


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: the file holding it, its shape, its safetensors dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def weight_files(weights: str | Path) -> list[Path]:
    """The safetensors files of ``weights``: the file itself; or in a directory, those its
    index names, else every ``*.safetensors`` there. Raises UnreadableCheckpoint."""
    p = Path(weights)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UnreadableCheckpoint(str(p), None, "no such file or directory")
    if (p / INDEX).is_file():
        return sorted({p / f for f in _index_map(p / INDEX).values()})
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise UnreadableCheckpoint(str(p), None, "no safetensors file in this directory")
    return files


def scan(weights: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint ``weights``, from the headers alone. Raises
    UnreadableCheckpoint for a missing, truncated or malformed file, a tensor in two
    files, or an index whose map disagrees with the files."""
    found: dict[str, TensorInfo] = {}
    for file in weight_files(weights):
        if not file.is_file():
            raise UnreadableCheckpoint(str(file), None, "is named by the index but absent")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open is not a dict)
                    sl = f.get_slice(name)
                    info = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
                    if name in found:
                        raise UnreadableCheckpoint(
                            str(file), name, f"is also in {found[name].file.name}"
                        )
                    found[name] = info
        except SafetensorError as exc:
            raise UnreadableCheckpoint(str(file), None, f"unreadable (truncated?): {exc}") from None
    index = Path(weights) / INDEX
    if index.is_file():
        for name, fname in _index_map(index).items():
            if name not in found or found[name].file.name != Path(fname).name:
                raise UnreadableCheckpoint(str(index), name, f"is not in {fname}")
        extra = sorted(set(found) - set(_index_map(index)))
        if extra:
            raise UnreadableCheckpoint(str(index), extra[0], "is in a file but not in the index")
    return found


def check_tensors(
    where: str,
    found: Mapping[str, TensorInfo],
    expected: Mapping[str, tuple[int, ...]],
    harmless: Iterable[str] = (),
) -> None:
    """Raise unless ``found`` holds exactly the ``expected`` tensors (names ending in one
    of ``harmless`` aside) with their shapes, in a dtype the runner computes from:
    MissingTensor, UnexpectedTensor, TensorShapeError, TensorDtypeError, naming it."""
    ends = tuple(harmless)
    for name in sorted(found):
        if name not in expected and not (ends and name.endswith(ends)):
            raise UnexpectedTensor(where, name, "is not a weight this model uses")
    for name, shape in expected.items():
        info = found.get(name)
        if info is None:
            raise MissingTensor(where, name, "is needed and in no file")
        if info.shape != shape:
            raise TensorShapeError(
                str(info.file), name, f"has shape {list(info.shape)}; the config says {list(shape)}"
            )
        if info.dtype not in DTYPES:
            raise TensorDtypeError(
                str(info.file), name, f"is {info.dtype}; weights must be one of {DTYPES}"
            )


def read_tensors(
    found: Mapping[str, TensorInfo], names: Iterable[str], cut: Callable[[str], Slice]
) -> dict[str, torch.Tensor]:
    """The ``names`` tensors (stored dtype), each only the rows/columns ``cut`` gives.
    Raises UnreadableCheckpoint if a file changed under the scan."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(found[name].file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, group in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in group:
                    out[name] = _take(f.get_slice(name), len(found[name].shape), *cut(name))
        except SafetensorError as exc:
            raise UnreadableCheckpoint(str(file), None, f"unreadable: {exc}") from None
    return out


def _take(sl, dims: int, rows: slice | None, cols: slice | None) -> torch.Tensor:
    if rows is None and cols is None:
        return sl[:]
    if dims == 1:
        return sl[rows]
    return sl[rows or slice(None), cols or slice(None)]


def _index_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
        mapping = data["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnreadableCheckpoint(str(index), None, f"not a safetensors index: {exc}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UnreadableCheckpoint(str(index), None, "its weight_map is not names to files")
    return mapping


__all__ = ["INDEX", "TensorInfo", "check_tensors", "read_tensors", "scan", "weight_files"]
