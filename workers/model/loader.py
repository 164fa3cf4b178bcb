"""Load a checkpoint directory (config.json + *.safetensors) into `HybridForCausalLM`, streaming.

Tensors are read one at a time from the memory-mapped shards (safetensors `safe_open`), renamed by
checkpoint_names.py (NemotronH incl. NVIDIA's `backbone.*` names and per-expert MoE tensors; Granite;
Bamba), cut to this tensor-parallel rank's slice and cast to the target dtype and device before the next
one is read: peak RAM is the rank's share of the weights plus about one tensor, never a second full copy.

Every parameter must be present with the right shape and every checkpoint tensor must have a place,
except `mtp.*`: present and complete -> `model.mtp` is built; absent (or the config has
num_nextn_predict_layers: 0) -> `model.mtp = None`; present but incomplete -> error.
`tie_word_embeddings`: a NemotronH checkpoint that stores `lm_head.weight` uses it (transformers'
NemotronH never ties); otherwise the head is the embedding matrix.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from workers.model.checkpoint_names import Piece, pieces_of
from workers.model.config import HybridModelConfig
from workers.model.errors import MissingFileError, MissingTensorError, TensorShapeError, UnexpectedTensorError
from workers.model.hybrid import HybridForCausalLM
from workers.model.kernels import select_kernels

log = logging.getLogger(__name__)

MTP_PREFIX = "mtp."


DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "half": torch.float16}


def resolve_dtype(model_dir: Path, dtype: str | torch.dtype | None) -> torch.dtype:
    """`auto` / None: the checkpoint config.json's `dtype` (or `torch_dtype`), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        config = json.loads((model_dir / "config.json").read_text())
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)} or a torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


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


def _names(items: list[str]) -> str:
    more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
    return ", ".join(items[:5]) + more


def _plan(config: HybridModelConfig, index: dict[str, Path], where: str) -> dict[str, list[Piece]]:
    """Our parameter name -> its pieces; UnexpectedTensorError for checkpoint tensors without a place."""
    plan: dict[str, list[Piece]] = defaultdict(list)
    homeless = []
    for source in sorted(index):
        pieces = pieces_of(source, config)
        if not pieces:
            homeless.append(source)
        for p in pieces:
            plan[p.target].append(p)
    if homeless:
        raise UnexpectedTensorError(f"{where}: unexpected tensor(s) {_names(homeless)}")
    return dict(plan)


class _Reader:
    """Reads pieces from the shards, one tensor (or one expert) in memory at a time. At most one shard is
    open (memory-mapped) at once: the caller asks for parameters in shard order, so the mapped pages of a
    finished shard are released before the next shard is touched."""

    def __init__(self, index: dict[str, Path]) -> None:
        self.index = index
        self._path: Path | None = None
        self._file = None

    def _open(self, source: str):
        from safetensors import safe_open

        path = self.index[source]
        if path != self._path:
            self.close()
            self._path, self._file = path, safe_open(str(path), framework="pt")
        return self._file

    def close(self) -> None:
        self._path = self._file = None  # safe_open unmaps when its handle is dropped

    def read(self, piece: Piece) -> torch.Tensor:
        f = self._open(piece.source)
        if piece.split_dim is None:
            return f.get_tensor(piece.source)
        sl = f.get_slice(piece.source)
        size = sl.get_shape()[piece.split_dim] // piece.num_parts
        cut = slice(piece.part * size, (piece.part + 1) * size)
        return sl[(slice(None),) * piece.split_dim + (cut,)]


def _materialize(name: str, pieces: list[Piece], shape: torch.Size, reader: _Reader, where: str,
                 rule: tuple[int, torch.Tensor] | None, dtype: torch.dtype, device) -> torch.Tensor:
    """One parameter: read, check the full shape, take the rank's slice, cast, place."""
    def finish(t: torch.Tensor, dim_shift: int = 0) -> torch.Tensor:
        src = t
        if rule is not None:
            t = t.index_select(rule[0] - dim_shift, rule[1])
        t = t.to(device=device, dtype=dtype).contiguous()
        # a tensor read without a cast can be a view of the memory-mapped file: own the memory, so a
        # checkpoint rewritten in place later cannot change (or fault) a served model
        return t.clone() if t.data_ptr() == src.data_ptr() else t

    experts = [p for p in pieces if p.expert is not None]
    if experts:  # per-expert tensors stacked into [E, ...]
        by_id = {p.expert: p for p in experts}
        missing = [f"{name}[{e}]" for e in range(shape[0]) if e not in by_id]
        if missing or len(experts) != len(pieces) or len(by_id) != len(experts) or max(by_id) >= shape[0]:
            raise MissingTensorError(f"{where}: {name}: expert tensors incomplete or out of range "
                                     f"({_names(missing) or sorted(by_id)})")
        parts = []
        for e in range(shape[0]):
            t = reader.read(by_id[e])
            if tuple(t.shape) != tuple(shape[1:]):
                raise TensorShapeError(f"{where}: {by_id[e].source} has shape {tuple(t.shape)}, config implies "
                                       f"{tuple(shape[1:])}")
            parts.append(finish(t, dim_shift=1))
        return torch.stack(parts)
    if len(pieces) != 1:
        raise UnexpectedTensorError(f"{where}: {name} is given by several tensors: "
                                    f"{_names([p.source for p in pieces])}")
    t = reader.read(pieces[0])
    if t.shape != shape:
        src = pieces[0].source if pieces[0].source == name else f"{pieces[0].source} (as {name})"
        raise TensorShapeError(f"{where}: {src} has shape {tuple(t.shape)}, config implies {tuple(shape)}")
    return finish(t)


def _index_shards(shards: list[Path]) -> dict[str, Path]:
    """Tensor name -> its shard (headers only: no tensor data is read)."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            index.update({k: shard for k in f.keys()})
    return index


def _select(config: HybridModelConfig, plan: dict[str, list[Piece]], where: str) -> tuple[dict, bool, bool]:
    """(plan without what this model does not use, with_mtp, tie lm_head to the embeddings)."""
    mtp_names = [n for n in plan if n.startswith(MTP_PREFIX)]
    with_mtp = config.num_nextn_predict_layers > 0 and bool(mtp_names)
    if mtp_names and not with_mtp:
        log.warning("%s: ignoring %d mtp.* tensors (num_nextn_predict_layers is 0)", where, len(mtp_names))
    if config.num_nextn_predict_layers and not mtp_names:
        log.info("%s: config asks for an MTP head but the checkpoint has no mtp.* tensors; mtp = None", where)
    if not with_mtp:
        plan = {k: v for k, v in plan.items() if not k.startswith(MTP_PREFIX)}
    # transformers' NemotronH never ties: a stored lm_head.weight is what it uses.
    tie = config.tie_word_embeddings and not (config.model_type == "nemotron_h" and "lm_head.weight" in plan)
    if tie:
        plan.pop("lm_head.weight", None)
    return plan, with_mtp, tie


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernels: str = "auto",
    tp_size: int = 1,
    tp_rank: int = 0,
) -> HybridForCausalLM:
    """Build the model described by model_dir/config.json and stream its weights in (eval, no grad).
    With tp_size > 1 the result is rank tp_rank's shard (tp_shard.py layout; attach a group before use)."""
    from workers.model.tp_shard import finish_shard, local_config, param_slices

    where = str(model_dir)
    config_path, shards = checkpoint_files(model_dir)
    config = HybridModelConfig.from_json_file(config_path)
    kernel_set = select_kernels(kernels, device)
    index = _index_shards(shards)
    plan, with_mtp, tie = _select(config, _plan(config, index, where), where)
    with torch.device("meta"):
        full = HybridForCausalLM(config, kernel_set, with_mtp=with_mtp, tie_lm_head=tie)
    expected = {k: v.shape for k, v in full.state_dict().items()}
    if tie:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(plan))
    if missing:
        raise MissingTensorError(f"{where}: missing tensor(s) {_names(missing)}")
    unexpected = sorted(set(plan) - set(expected))
    if unexpected:
        sources = [p.source for n in unexpected for p in plan[n]]
        raise UnexpectedTensorError(f"{where}: unexpected tensor(s) {_names(sources)}")
    rules = param_slices(full, tp_size, tp_rank) if tp_size > 1 else {}
    if tp_size > 1 and tp_rank > 0:
        expected.pop("lm_head.weight", None)  # logits are computed on rank 0 only
    reader = _Reader(index)
    order = sorted(expected, key=lambda n: (str(index[plan[n][0].source]), n))  # shard by shard
    state = {n: _materialize(n, plan[n], expected[n], reader, where, rules.get(n), dtype, device) for n in order}
    reader.close()
    local = local_config(config, tp_size) if tp_size > 1 else config
    with torch.device("meta"):
        model = HybridForCausalLM(local, kernel_set, with_mtp=with_mtp, tie_lm_head=tie)
    if tp_size > 1:
        return finish_shard(model, state, tp_rank, dtype, device, norm_spans_ranks=config.n_groups == 1)
    if tie:
        state["lm_head.weight"] = state["model.embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tie:
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
