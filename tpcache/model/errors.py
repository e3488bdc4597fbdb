"""The refusals of a model runner and its checkpoint: ``RunnerConfigError`` and its kinds.

A leaf without torch, so the config parser (``hf_config``), the checkpoint reader and
``runner`` share these classes. Each error names what stopped the load: the config
key (``key``) or the tensor (``tensor``) and the file.
"""

from __future__ import annotations

from tpcache.errors import TpcacheError


class RunnerConfigError(TpcacheError, ValueError):
    """A runner or layout that cannot work here: a bad shape, heads that do not divide by
    tp, a layout that does not fit the pool or the cache, a checkpoint this runner does
    not compute exactly. Raised before anything starts."""


class ConfigKeyError(RunnerConfigError):
    """A config key (``key``) that stops the model from loading: the message says why."""

    def __init__(self, path: str, key: str, why: str) -> None:
        super().__init__(f"{path}: {key!r} {why}")
        self.key = key


class UnknownConfigKey(ConfigKeyError):
    """A key this runner does not know: it might change the computation, so it refuses."""


class UnsupportedConfig(ConfigKeyError):
    """A key whose value asks for something this runner does not compute (a RoPE type,
    a sliding window, a bias on the MLP, an activation other than silu)."""


class MissingConfigKey(ConfigKeyError):
    """A key the model's shape needs is absent or null."""


class CheckpointError(RunnerConfigError):
    """Weights that do not load: ``tensor`` (None for the whole file) in ``path``."""

    def __init__(self, path: str, tensor: str | None, why: str) -> None:
        super().__init__(f"{path}: {why}" if tensor is None else f"{path}: {tensor!r} {why}")
        self.path, self.tensor = path, tensor


class UnreadableCheckpoint(CheckpointError):
    """No weights file, or one that is truncated or malformed (its header does not
    describe its bytes), or an index that names files or tensors that are not there."""


class MissingTensor(CheckpointError):
    """A weight the model needs is in no file."""


class UnexpectedTensor(CheckpointError):
    """A weight the model does not use (dropping it would compute something else)."""


class TensorShapeError(CheckpointError):
    """A weight of another shape than the config gives."""


class TensorDtypeError(CheckpointError):
    """A weight stored in a dtype other than float32, float16 or bfloat16."""


__all__ = [
    "CheckpointError",
    "ConfigKeyError",
    "MissingConfigKey",
    "MissingTensor",
    "RunnerConfigError",
    "TensorDtypeError",
    "TensorShapeError",
    "UnexpectedTensor",
    "UnknownConfigKey",
    "UnreadableCheckpoint",
    "UnsupportedConfig",
]
