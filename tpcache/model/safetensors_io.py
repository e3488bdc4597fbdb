"""A small reader and writer of the safetensors format, so a runner can load real weights
without another dependency.

The format: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
possibly padded with spaces), then the tensors' raw little-endian bytes, row-major, at
those offsets (relative to the end of the header). The reader maps the file and copies
out only what is asked for (a rank reads its own rows or columns of a weight, not the
whole file); every field is checked before any tensor is read.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tpcache.closing import Closing
from tpcache.errors import TpcacheError

# safetensors dtype -> (numpy dtype holding its bytes, torch dtype); BF16 travels as u16.
_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "F64": ("<f8", torch.float64),
    "F32": ("<f4", torch.float32),
    "F16": ("<f2", torch.float16),
    "BF16": ("<u2", torch.bfloat16),
    "I64": ("<i8", torch.int64),
    "I32": ("<i4", torch.int32),
    "I16": ("<i2", torch.int16),
    "I8": ("i1", torch.int8),
    "U8": ("u1", torch.uint8),
    "BOOL": ("?", torch.bool),
}
_BY_TORCH = {t: name for name, (_np, t) in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # the reference implementation's limit


class SafetensorsError(TpcacheError, ValueError):
    """A file that is not valid safetensors, or a tensor it does not hold."""


def _parse_header(path: str, size: int, head: bytes) -> tuple[int, dict[str, dict]]:
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head[:8], "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise SafetensorsError(f"{path}: header length {n} does not fit the file of {size}")
    try:
        header = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"{path}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        spans.append((*_check_entry(path, name, info, data), name))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return 8 + n, header


def _check_entry(path: str, name: str, info: Any, data: int) -> tuple[int, int]:
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has no known dtype: {info!r}")
    shape, offs = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
    ):
        raise SafetensorsError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or any(isinstance(o, bool) or not isinstance(o, int) for o in offs)
        or not 0 <= offs[0] <= offs[1] <= data
    ):
        raise SafetensorsError(f"{path}: tensor {name!r} has bad data_offsets {offs!r}")
    itemsize = np.dtype(_DTYPES[info["dtype"]][0]).itemsize
    if offs[1] - offs[0] != int(np.prod(shape, dtype=np.int64)) * itemsize:
        raise SafetensorsError(
            f"{path}: tensor {name!r} of shape {shape} takes {offs[1] - offs[0]} bytes"
        )
    return offs[0], offs[1]


class SafeFile(Closing):
    """One safetensors file, mapped read-only. ``get(name, rows=, cols=)`` copies out a
    whole tensor or a slice of a 2-D one. Close it (or use ``with``) to unmap."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(min(size, 8 + _MAX_HEADER))
            self._start, self._header = _parse_header(self.path, size, head)
            # An empty data section cannot be mapped; such a file holds only empty tensors.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def names(self) -> list[str]:
        return sorted(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (a copy, in its stored dtype), or ``[rows, cols]`` of a 2-D one."""
        info = self._entry(name)
        np_dtype, t_dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            arr = np.zeros(shape, dtype=np_dtype)
        else:
            assert self._map is not None
            arr = np.frombuffer(self._map, np_dtype, (end - begin) // np.dtype(np_dtype).itemsize,
                                self._start + begin).reshape(shape)  # fmt: skip
        if rows is not None or cols is not None:
            if arr.ndim != 2:
                raise SafetensorsError(f"{self.path}: {name!r} is {arr.ndim}-D; slices need 2-D")
            arr = arr[rows or slice(None), cols or slice(None)]
        out = torch.from_numpy(np.array(arr))  # a copy: the map may be closed later
        return out.view(t_dtype) if t_dtype == torch.bfloat16 else out

    def _entry(self, name: str) -> dict:
        if name not in self._header:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}")
        return self._header[name]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """``path`` itself, or every ``*.safetensors`` file in the directory ``path`` (a model
    saved in shards), sorted. Raises SafetensorsError if there is none."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise SafetensorsError(f"no safetensors file at {p}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, SafeFile]]:
    """(name, the open file holding it) for every tensor of ``files``; the caller closes
    the files. Raises SafetensorsError for a name held twice."""
    seen: dict[str, str] = {}
    for path in files:
        f = SafeFile(path)
        for name in f.names():
            if name in seen:
                raise SafetensorsError(f"tensor {name!r} is in both {seen[name]} and {path}")
            seen[name] = str(path)
            yield name, f


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as one safetensors file (names sorted, header padded to 8 bytes
    as the reference writer does). Raises SafetensorsError for an unsupported dtype."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _BY_TORCH:
            raise SafetensorsError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        raw = (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {
            "dtype": _BY_TORCH[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


__all__ = ["SafeFile", "SafetensorsError", "iter_tensors", "safetensors_files", "save_file"]
