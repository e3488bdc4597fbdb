"""One TP rank's shard of the KV pool: K and V per layer, addressed by slot id.

Every rank of a TP group holds the same number of slots (agreed by a MIN all-reduce
over the ranks' budgets, see ``slots_that_fit``), so a slot id that the cache mirror
hands out means the same token on every rank; each rank stores only its
``kv_heads // tp`` heads of that token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tpcache.errors import TpcacheError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

SlotIds = torch.Tensor | np.ndarray | Sequence[int]


class PoolConfigError(TpcacheError, ValueError):
    """A pool shape or budget that cannot work (e.g. heads that do not divide by tp)."""


class PoolError(TpcacheError, ValueError):
    """A bad write or read (layer, slot ids, shape, dtype, device); nothing was changed."""


def check_positive_int(
    name: str, value: object, error: type[TpcacheError] = PoolConfigError
) -> None:
    """Raises ``error`` naming ``name`` unless ``value`` is an int >= 1 (the pool's and the
    models' shapes share this check and its message)."""
    # bool is an int subclass; True as a head count is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PoolSpec:
    """Shape of the KV pool of a whole TP group; each rank holds one head shard.

    ``kv_heads`` is the total over the group; ``heads_per_rank`` what one rank stores.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    tp: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "tp"):
            check_positive_int(name, getattr(self, name))
        if self.kv_heads % self.tp != 0:
            raise PoolConfigError(f"kv_heads={self.kv_heads} is not divisible by tp={self.tp}")
        if self.dtype not in TORCH_DTYPES:
            raise PoolConfigError(f"dtype={self.dtype!r} is not one of {sorted(TORCH_DTYPES)}")

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.tp

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot costs on one rank: K and V, every layer, this rank's heads."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.heads_per_rank * self.head_dim * itemsize


def slots_that_fit(spec: PoolSpec, budget_bytes: int) -> int:
    """How many whole slots of ``spec`` fit in ``budget_bytes`` on one rank (may be 0).

    Pure arithmetic; the group's capacity is the MIN of this over its ranks.
    Raises PoolConfigError for a negative or non-int budget.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise PoolConfigError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    return budget_bytes // spec.bytes_per_slot


def device_budget_bytes(device: torch.device, fraction: float, cpu_bytes: int) -> int:
    """Bytes this rank may give to its KV pool on ``device``.

    On CUDA: ``fraction`` of the free bytes that ``torch.cuda.mem_get_info`` reports now
    (free memory differs between ranks, which is why capacity is agreed by MIN). On the
    CPU: ``cpu_bytes``, a configured budget (free host memory says little about what a
    test or a shared host can spare). Changes nothing; raises PoolConfigError for a
    fraction outside (0, 1] or a negative ``cpu_bytes``.
    """
    if not 0.0 < fraction <= 1.0:
        raise PoolConfigError(f"fraction must be in (0, 1], got {fraction!r}")
    if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes < 0:
        raise PoolConfigError(f"cpu_bytes must be an int >= 0, got {cpu_bytes!r}")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    if device.type == "cpu":
        return cpu_bytes
    raise PoolConfigError(f"no budget rule for device {device}")


def rank_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class KVPool:
    """K and V buffers of one rank: per layer, ``[num_slots, heads_per_rank, head_dim]``.

    Shaped slot-major so that one ``index_copy_`` / ``index_select`` on dim 0 moves a
    whole step's tokens, and so that attention kernels can take a layer's buffer and a
    slot-id tensor as they are. ``write`` and ``read`` validate everything before they
    touch a buffer, so a PoolError means the pool is unchanged. Not thread-safe.
    """

    def __init__(
        self, spec: PoolSpec, num_slots: int, device: torch.device, *, pin: bool = False
    ) -> None:
        """``pin``: page-locked host memory (a host pool that CUDA copies overlap with)."""
        check_positive_int("num_slots", num_slots)
        if device.type == "cuda" and device.index is None:
            # Pin the index so equality checks against tensors' devices are exact.
            device = torch.device("cuda", torch.cuda.current_device())
        self._spec = spec
        self._num_slots = num_slots
        self._device = device
        shape = (num_slots, spec.heads_per_rank, spec.head_dim)
        # Owned by this pool; callers get views through layer_buffers() or copies via read().
        self._k = [
            torch.zeros(shape, dtype=spec.torch_dtype, device=device, pin_memory=pin)
            for _ in range(spec.num_layers)
        ]
        self._v = [
            torch.zeros(shape, dtype=spec.torch_dtype, device=device, pin_memory=pin)
            for _ in range(spec.num_layers)
        ]

    @property
    def spec(self) -> PoolSpec:
        return self._spec

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes held by this rank's buffers (``num_slots * spec.bytes_per_slot``)."""
        return self._num_slots * self._spec.bytes_per_slot

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live K and V buffers of ``layer`` (views, not copies), for kernels.

        Writing through them bypasses validation; raises PoolError for a bad layer.
        """
        self._check_layer(layer)
        return self._k[layer], self._v[layer]

    def write(self, layer: int, slots: SlotIds, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k[i]`` and ``v[i]`` at slot ``slots[i]`` of ``layer``.

        ``k`` and ``v`` must be ``[len(slots), heads_per_rank, head_dim]`` with the pool's
        dtype, on the pool's device. Slot ids must be distinct and in ``[0, num_slots)``
        (a duplicate would make the result depend on scatter order). Raises PoolError,
        with nothing written, on any violation.
        """
        self._check_layer(layer)
        idx = self._slot_tensor(slots, unique=True)
        self._check_kv("k", k, idx.numel())
        self._check_kv("v", v, idx.numel())
        self._k[layer].index_copy_(0, idx, k)
        self._v[layer].index_copy_(0, idx, v)

    def read(self, layer: int, slots: SlotIds) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V at ``slots`` of ``layer``, each ``[len(slots), heads, dim]``.

        Changes nothing. Slot ids may repeat. Raises PoolError for a bad layer or slot.
        """
        self._check_layer(layer)
        idx = self._slot_tensor(slots, unique=False)
        return self._k[layer].index_select(0, idx), self._v[layer].index_select(0, idx)

    def zero_(self) -> None:
        """Set every slot of every layer to zero (the state of a new pool)."""
        for buf in (*self._k, *self._v):
            buf.zero_()

    def clear(self) -> None:
        """Same as ``zero_()``: after a cache reset no stale KV stays readable."""
        self.zero_()

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise PoolError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self._spec.num_layers:
            raise PoolError(f"layer={layer} is out of range [0, {self._spec.num_layers})")

    def _check_kv(self, name: str, t: torch.Tensor, n: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise PoolError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = (n, self._spec.heads_per_rank, self._spec.head_dim)
        if tuple(t.shape) != want:
            raise PoolError(f"{name} has shape {tuple(t.shape)}, expected {want}")
        if t.dtype != self._spec.torch_dtype:
            raise PoolError(f"{name} has dtype {t.dtype}, expected {self._spec.torch_dtype}")
        if t.device != self._device:
            raise PoolError(f"{name} is on {t.device}, the pool is on {self._device}")

    def _slot_tensor(self, slots: SlotIds, *, unique: bool) -> torch.Tensor:
        """Validate ``slots`` and return them as one int64 tensor on the pool's device."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise PoolError(f"slot ids must be integers, got dtype {slots.dtype}")
            if slots.dim() != 1:
                raise PoolError(f"slot ids must be 1-D, got shape {tuple(slots.shape)}")
            idx = slots.to(device=self._device, dtype=torch.int64)
            if idx.numel():
                lo, hi = (int(x) for x in torch.aminmax(idx))
                self._check_range(lo, hi)
                if unique and torch.unique(idx).numel() != idx.numel():
                    raise PoolError(f"slot ids for a write repeat: {idx.numel()} ids")
            return idx
        arr = np.asarray(slots)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise PoolError(f"slot ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise PoolError(f"slot ids must be 1-D, got shape {arr.shape}")
        if arr.size:
            self._check_range(int(arr.min()), int(arr.max()))
            if unique and np.unique(arr).size != arr.size:
                dup = arr.size - np.unique(arr).size
                raise PoolError(f"slot ids for a write repeat: {dup} duplicates in {arr.size}")
        # One host-to-device transfer per call, whatever the number of tokens.
        return torch.as_tensor(arr.astype(np.int64, copy=False), device=self._device)

    def _check_range(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self._num_slots:
            raise PoolError(
                f"slot ids span [{lo}, {hi}], outside [0, {self._num_slots}) of this pool"
            )
