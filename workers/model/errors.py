"""Exception types of the model layer: one base class, one subclass per thing that can go wrong."""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error raised by `workers.model`."""


class ConfigError(ModelError, ValueError):
    """config.json (or an init-model YAML) is missing a field or holds an invalid value."""


class UnsupportedLayerError(ConfigError):
    """The layer pattern names a layer kind this implementation does not run (e.g. `X`)."""

    def __init__(self, layer_idx: int, char: str, where: str = "hybrid_override_pattern") -> None:
        self.layer_idx = layer_idx
        self.char = char
        super().__init__(
            f"{where}: layer {layer_idx} has unsupported kind {char!r} "
            "(supported: 'M' Mamba2, '*' attention, '-' MLP, 'E' MoE)"
        )


class CheckpointError(ModelError):
    """The checkpoint directory is incomplete or does not match its config."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """config.json or the *.safetensors files are absent."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is not in the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the model has no place for."""


class TensorShapeError(CheckpointError):
    """A checkpoint tensor's shape differs from what the config implies."""


class KernelUnavailableError(ModelError, RuntimeError):
    """`kernels="cuda"` was asked for but a CUDA kernel package is not installed (or no CUDA device)."""


class ForwardBatchError(ModelError, ValueError):
    """A ForwardBatch is inconsistent with itself or with the caches (lengths, block tables, slots)."""


class TensorParallelError(ConfigError):
    """A tensor-parallel layout cannot be built: heads / groups / channels not divisible by tp_size,
    a bad backend or init_method."""
