"""HybridModelConfig: parsing, derived sizes, validation messages, transformers compatibility."""

from __future__ import annotations

import pytest
import yaml

from tests.model.helpers import TINY_YAML
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.errors import ConfigError, UnsupportedLayerError


@pytest.fixture
def raw():
    return yaml.safe_load(TINY_YAML.read_text())


def test_tiny_config_derived_sizes(raw):
    cfg = HybridModelConfig.from_dict(raw)
    assert cfg.layer_kinds[:4] == (LayerKind.MAMBA, LayerKind.MLP, LayerKind.MAMBA, LayerKind.ATTENTION)
    assert cfg.attention_layer_ids == (3, 8) and cfg.mamba_layer_ids == (0, 2, 5, 7)
    assert cfg.mlp_layer_ids == (1, 4, 6, 9) and cfg.num_hidden_layers == 10
    assert cfg.d_inner == 512 and cfg.conv_dim == 512 + 2 * 2 * 32 and cfg.in_proj_dim == 512 + 640 + 16
    assert cfg.num_nextn_predict_layers == 1 and cfg.mtp_attention_layer_ids == (0,)
    assert cfg.dt_limit == (0.001, float("inf"))


def test_block_type_list_and_legacy_aliases(raw):
    raw.pop("hybrid_override_pattern")
    raw["layers_block_type"] = ["linear_attention", "mlp", "full_attention"]
    raw["mamba_chunk_size"] = raw.pop("chunk_size")
    raw["mtp_layers_block_type"] = ["full_attention"]
    raw.pop("mtp_hybrid_override_pattern")
    cfg = HybridModelConfig.from_dict(raw)
    assert (
        cfg.hybrid_override_pattern == "M-*"
        and cfg.chunk_size == 64
        and cfg.mtp_hybrid_override_pattern == "*"
    )


def test_mtp_fields_default_to_absent(raw):
    for key in ("num_nextn_predict_layers", "mtp_hybrid_override_pattern"):
        raw.pop(key)
    cfg = HybridModelConfig.from_dict(raw)
    assert (
        cfg.num_nextn_predict_layers == 0 and cfg.mtp_layer_kinds == () and cfg.mtp_attention_layer_ids == ()
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"n_groups": 3}, "multiple of n_groups"),
        ({"mlp_hidden_act": "swiglu"}, "mlp_hidden_act"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
        ({"mtp_hybrid_override_pattern": "M-"}, "mtp_hybrid_override_pattern"),
        ({"hybrid_override_pattern": ""}, "empty"),
        ({"time_step_min": 0.5}, "time_step_min"),
    ],
)
def test_validation_messages(raw, change, match):
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        HybridModelConfig.from_dict(raw)


def test_unsupported_layer_error_fields(raw):
    raw["hybrid_override_pattern"] = "M*X"
    with pytest.raises(UnsupportedLayerError) as info:
        HybridModelConfig.from_dict(raw)
    assert (info.value.layer_idx, info.value.char) == (2, "X") and "'E' MoE" in str(info.value)


def test_moe_layer_without_moe_fields_names_the_field(raw):
    raw["hybrid_override_pattern"] = "M*E"
    with pytest.raises(ConfigError, match="n_routed_experts must be a positive integer"):
        HybridModelConfig.from_dict(raw)


def test_hf_dict_round_trips_and_transformers_agrees(raw):
    cfg = HybridModelConfig.from_dict(raw)
    assert HybridModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    transformers = pytest.importorskip("transformers")
    hf = transformers.NemotronHConfig(**cfg.to_hf_dict())
    assert hf.hybrid_override_pattern == cfg.hybrid_override_pattern
    assert hf.mtp_hybrid_override_pattern == "*-" and hf.num_hidden_layers == 10
    assert (hf.n_groups, hf.ssm_state_size, hf.chunk_size, hf.head_dim) == (2, 32, 64, 64)
