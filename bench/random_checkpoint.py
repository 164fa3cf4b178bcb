"""A random checkpoint for one benchmark run (no weights can be downloaded): written from a model
config into a temporary folder and removed when the run ends."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

TINY_CONFIG = "configs/models/tiny-nemotron-h.yaml"


class CheckpointError(RuntimeError):
    """The config could not be turned into a checkpoint."""


@contextlib.contextmanager
def random_checkpoint(config: str = TINY_CONFIG, seed: int = 0, **overrides) -> Iterator[str]:
    """The folder of a checkpoint with seeded random weights from `config` (`overrides`: config
    fields replaced first), for the `with` block only. Raises `CheckpointError`."""
    from workers.model.init_model import main as init_main

    with tempfile.TemporaryDirectory(prefix="hybridserve-checkpoint-") as folder:
        if overrides:
            fields = yaml.safe_load(Path(config).read_text())
            fields.update(overrides)
            config = str(Path(folder) / "config.yaml")
            Path(config).write_text(yaml.safe_dump(fields))
        out = str(Path(folder) / "model")
        if init_main(["--config", config, "--out", out, "--seed", str(seed)]) != 0:
            raise CheckpointError(f"could not write a checkpoint from {config}")
        yield out
