"""What one ``tpcache generate`` run is asked for (``GenerateOptions``, with the model's
size, ``ModelSize``) and the requests it sends (``GenRequest``): records validated on
construction, apart from the run (``generate.py``) and its report (``gen_report.py``),
which both read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpcache.cache.errors import InvalidNamespace
from tpcache.cache.namespace import CacheNamespace, make_namespace
from tpcache.coordinator.errors import CoordinatorConfigError
from tpcache.coordinator.step_types import step_timeout_for
from tpcache.harness.gen_wire import GenerateError
from tpcache.trace import check_scale

MAX_POLL_S = (2**31 - 1) // 1000  # the longest wait ZMQ's poll takes, in seconds


@dataclass(frozen=True)
class ModelSize:
    """The reference runner's size (its vocabulary comes from the slice)."""

    hidden: int = 128
    heads: int = 4
    ffn: int = 512
    layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "ffn", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerateError(f"model {name} must be an int >= 1, got {value!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise GenerateError(
                f"hidden={self.hidden} must split into {self.heads} heads of an even size"
            )

    def runner_args(self, vocab: int) -> dict[str, Any]:
        return {
            "vocab": vocab,
            "hidden": self.hidden,
            "heads": self.heads,
            "head_dim": self.hidden // self.heads,
            "ffn": self.ffn,
            "num_layers": self.layers,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class GenerateOptions:
    """One ``tpcache generate`` run; validated on construction (``GenerateError``)."""

    scale: int = 32  # k of the scale 1/k
    page_size: int = 16
    policy: str = "lru"
    capacity: int | None = None  # tokens; None: holds the whole slice
    tp: int = 2
    clients: int = 8
    step_tokens: int = 256
    model: ModelSize = field(default_factory=ModelSize)
    timeout_s: float = 120.0  # a silent loop or client, a collective (and a step: below)
    salt: str | None = None  # every request's cache namespace: this salt and LoRA id
    lora_id: int | None = None

    def __post_init__(self) -> None:
        try:
            check_scale(self.scale)
        except ValueError as exc:
            raise GenerateError(str(exc)) from None
        for name in ("page_size", "tp", "clients", "step_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerateError(f"{name} must be an int >= 1, got {value!r}")
        if self.capacity is not None and self.capacity < self.page_size:
            raise GenerateError(f"capacity {self.capacity} is less than a page")
        if self.model.heads % self.tp or self.model.ffn % self.tp:
            raise GenerateError(
                f"the model's heads={self.model.heads} and ffn={self.model.ffn} must divide "
                f"by tp={self.tp}"
            )
        try:
            step_timeout_for(self.timeout_s, "timeout_s")  # refused here, not at the start
            self.namespace()
        except (CoordinatorConfigError, InvalidNamespace) as exc:
            raise GenerateError(str(exc)) from None
        if self.timeout_s > MAX_POLL_S:
            # The clients wait with ZMQ's poll, whose milliseconds are a C int: a longer
            # wait raised OverflowError in each client thread and the run hung silently.
            raise GenerateError(
                f"timeout_s must be at most {MAX_POLL_S:,} s (ZMQ's poll), got {self.timeout_s!r}"
            )

    @property
    def step_timeout_s(self) -> float:
        """The coordinator's wait for a step's results, derived from ``timeout_s`` as
        ``tpcache demo`` and ``serve`` derive theirs (``step_timeout_for``): a rank hung
        where no peer notices is found in that time, not after a fixed default."""
        return step_timeout_for(self.timeout_s, "timeout_s")

    def namespace(self) -> CacheNamespace | None:
        """The requests' cache namespace (``None``: the default one)."""
        return make_namespace(self.lora_id, None, self.salt)


@dataclass(frozen=True)
class GenRequest:
    seq: int
    prompt: np.ndarray
    max_new: int
