"""Load a NemotronH checkpoint directory (config.json + *.safetensors) into `HybridForCausalLM`.

Tensor names are transformers' (`model.*`, `lm_head.weight`); NVIDIA's original `backbone.*` prefix is
accepted too. Every tensor the model needs must be present with the right shape and every checkpoint
tensor must have a place, except `mtp.*`: present and complete -> `model.mtp` is built; absent (or the
config has num_nextn_predict_layers: 0) -> `model.mtp = None`; present but incomplete -> error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from workers.model.config import HybridModelConfig
from workers.model.errors import MissingFileError, MissingTensorError, TensorShapeError, UnexpectedTensorError
from workers.model.hybrid import HybridForCausalLM
from workers.model.kernels import select_kernels

log = logging.getLogger(__name__)

MTP_PREFIX = "mtp."


def checkpoint_files(model_dir: str | Path) -> tuple[Path, list[Path]]:
    """(config.json, sorted *.safetensors) of a checkpoint dir; MissingFileError naming what is absent."""
    root = Path(model_dir)
    if not root.is_dir():
        raise MissingFileError(f"checkpoint directory {root} does not exist")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{root}: no config.json")
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise MissingFileError(f"{root}: no *.safetensors weight files")
    return config_path, shards


def _read_tensors(shards: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, t in load_file(str(shard)).items():
            if name.startswith("backbone."):
                name = "model." + name[len("backbone.") :]
            tensors[name] = t
    return tensors


def _check_names(expected: dict[str, torch.Size], found: dict[str, torch.Tensor], where: str) -> None:
    missing = sorted(set(expected) - set(found))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise MissingTensorError(f"{where}: missing tensor(s) {', '.join(missing[:5])}{more}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise UnexpectedTensorError(f"{where}: unexpected tensor(s) {', '.join(unexpected[:5])}{more}")
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise TensorShapeError(
                f"{where}: {name} has shape {tuple(found[name].shape)}, config implies {tuple(shape)}"
            )


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernels: str = "auto",
) -> HybridForCausalLM:
    """Build the model described by model_dir/config.json and load its weights (eval mode, no grad)."""
    config_path, shards = checkpoint_files(model_dir)
    config = HybridModelConfig.from_json_file(config_path)
    kernel_set = select_kernels(kernels, device)
    tensors = _read_tensors(shards)
    mtp_names = [n for n in tensors if n.startswith(MTP_PREFIX)]
    with_mtp = config.num_nextn_predict_layers > 0 and bool(mtp_names)
    if mtp_names and not with_mtp:
        log.warning(
            "%s: ignoring %d mtp.* tensors (num_nextn_predict_layers is 0)", model_dir, len(mtp_names)
        )
        for n in mtp_names:
            tensors.pop(n)
    if config.num_nextn_predict_layers and not mtp_names:
        log.info(
            "%s: config asks for an MTP head but the checkpoint has no mtp.* tensors; mtp = None", model_dir
        )

    with torch.device("meta"):
        model = HybridForCausalLM(config, kernel_set, with_mtp=with_mtp)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    _check_names(expected, tensors, str(model_dir))
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embeddings.weight"]
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embeddings.weight
    model.requires_grad_(False)
    return model.eval()


_FULL_HASH_BYTES = 256 * 2**20
_SAMPLE_WINDOWS, _WINDOW_BYTES = 64, 64 * 2**10


def model_fingerprint(model_dir: str | Path) -> str:
    """Stable 128-bit hex id of a checkpoint: sha256 over config.json and every shard's name and bytes.
    Shards over 256 MiB are sampled (header + 64 evenly spaced 64 KiB windows) to stay fast on real
    checkpoints; random or trained weights differ in every window."""
    config_path, shards = checkpoint_files(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads(config_path.read_text()), sort_keys=True).encode())
    for shard in shards:
        size = shard.stat().st_size
        h.update(f"{shard.name}:{size}".encode())
        with shard.open("rb") as f:
            if size <= _FULL_HASH_BYTES:
                h.update(f.read())
                continue
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            for i in range(_SAMPLE_WINDOWS):
                f.seek(i * (size - _WINDOW_BYTES) // (_SAMPLE_WINDOWS - 1))
                h.update(f.read(_WINDOW_BYTES))
    return h.hexdigest()[:32]
