"""Loader: clear errors for broken checkpoints; NVIDIA `backbone.` names; fingerprint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.helpers import make_checkpoint, make_tokens, run_chunks
from workers.model.errors import (
    ConfigError,
    MissingFileError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedLayerError,
)
from workers.model.loader import load_model, model_fingerprint


@pytest.fixture
def ckpt(tiny_nomtp_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_nomtp_dir, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_unknown_layer_kind_is_unsupported_with_index_and_char(ckpt):
    _edit_config(ckpt, hybrid_override_pattern="M-M*-MXM*-")
    with pytest.raises(UnsupportedLayerError, match=r"layer 6 .*'X'") as info:
        load_model(ckpt)
    assert (info.value.layer_idx, info.value.char) == (6, "X")


def test_unknown_layer_char_and_block_type_list(ckpt):
    _edit_config(ckpt, hybrid_override_pattern="M-X")
    with pytest.raises(UnsupportedLayerError, match=r"layer 2 .*'X'"):
        load_model(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("hybrid_override_pattern")
    cfg["layers_block_type"] = ["linear_attention", "sliding_attention"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedLayerError, match="layer 1"):
        load_model(ckpt)


def test_missing_config_and_weights(ckpt, tmp_path):
    with pytest.raises(MissingFileError, match="does not exist"):
        load_model(tmp_path / "nope")
    (ckpt / "model.safetensors").rename(tmp_path / "weights.bak")
    with pytest.raises(MissingFileError, match=r"no \*\.safetensors"):
        load_model(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(MissingFileError, match="no config.json"):
        load_model(ckpt)


def test_missing_unexpected_and_misshapen_tensors(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.3.mixer.k_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.3\.mixer\.k_proj\.weight"):
        load_model(ckpt)
    _edit_tensors(
        ckpt,
        lambda t: t.update(
            {
                "model.layers.3.mixer.k_proj.weight": torch.zeros(128, 256),
                "model.layers.0.mixer.extra.weight": torch.zeros(2),
            }
        ),
    )
    with pytest.raises(UnexpectedTensorError, match="extra"):
        load_model(ckpt)
    _edit_tensors(
        ckpt,
        lambda t: (
            t.pop("model.layers.0.mixer.extra.weight"),
            t.update({"model.layers.3.mixer.k_proj.weight": torch.zeros(64, 256)}),
        ),
    )
    with pytest.raises(TensorShapeError, match=r"k_proj.*\(64, 256\).*\(128, 256\)"):
        load_model(ckpt)


def test_invalid_config_values(ckpt):
    _edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        load_model(ckpt)
    _edit_config(ckpt, num_key_value_heads=2, model_type="llama")
    with pytest.raises(ConfigError, match="model_type"):
        load_model(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_model(ckpt)


def test_backbone_prefix_loads_like_model_prefix(ckpt, tiny_nomtp_dir):
    _edit_tensors(
        ckpt,
        lambda t: t.update(
            {k.replace("model.", "backbone.", 1): t.pop(k) for k in [k for k in t if k.startswith("model.")]}
        ),
    )
    a, b = load_model(ckpt), load_model(tiny_nomtp_dir)
    ids = make_tokens(9)
    la = run_chunks(a, a.allocate_caches(1, 16, 1), ids, [9], torch.tensor([0]), 0)
    lb = run_chunks(b, b.allocate_caches(1, 16, 1), ids, [9], torch.tensor([0]), 0)
    assert torch.equal(la, lb)


def test_dtype_and_kernels_arguments(tiny_nomtp_dir):
    m = load_model(tiny_nomtp_dir, dtype=torch.bfloat16, kernels="torch")
    assert m.dtype == torch.bfloat16 and m.kernels.name == "torch"
    caches = m.allocate_caches(2, 16, 1)
    assert caches.kv[3][0].dtype == torch.bfloat16 and caches.ssm[0].dtype == torch.float32
    out = run_chunks(m, caches, make_tokens(20), [20], torch.tensor([0, 1]), 0)
    assert torch.isfinite(out).all()


def test_fingerprint_is_stable_and_seed_sensitive(tiny_nomtp_dir, tmp_path):
    assert model_fingerprint(tiny_nomtp_dir) == model_fingerprint(tiny_nomtp_dir)
    other = make_checkpoint(tmp_path / "other", seed=4, mtp=False)
    assert model_fingerprint(other) != model_fingerprint(tiny_nomtp_dir)
    assert len(model_fingerprint(other)) == 32
