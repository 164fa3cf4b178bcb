"""`HybridModelConfig`: the NemotronH config.json fields we run, validated, with derived sizes.

Field names are the transformers `NemotronHConfig` names, so one config.json serves both. The layer
pattern is kept as the `hybrid_override_pattern` string (`M` Mamba2, `*` attention, `-` MLP); a
`layers_block_type` list is accepted too. Legacy aliases (`mamba_n_groups`, `mamba_d_conv`, ...) map to
their current names the way transformers maps them.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from workers.model.errors import ConfigError, MissingFileError, UnsupportedLayerError


class LayerKind(str, enum.Enum):
    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"


_BLOCK_TYPE_TO_CHAR = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
_CHAR_TO_BLOCK_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
MLP_ACTIVATIONS = ("relu2", "silu", "gelu", "relu")


def parse_pattern(pattern: str, where: str = "hybrid_override_pattern") -> tuple[LayerKind, ...]:
    """'M-M*' -> (MAMBA, MLP, MAMBA, ATTENTION); any other char raises UnsupportedLayerError(index, char)."""
    kinds = []
    for i, char in enumerate(pattern):
        try:
            kinds.append(LayerKind(char))
        except ValueError:
            raise UnsupportedLayerError(i, char, where) from None
    return tuple(kinds)


def _pattern_from_block_types(types: Any, where: str) -> str:
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where} must be a list of strings, got {types!r}")
    chars = []
    for i, t in enumerate(types):
        if t not in _BLOCK_TYPE_TO_CHAR:
            raise UnsupportedLayerError(i, t, where)
        chars.append(_BLOCK_TYPE_TO_CHAR[t])
    return "".join(chars)


@dataclass(frozen=True)
class HybridModelConfig:
    """What the model layer reads from config.json. Mamba names follow the paper: d_state (ssm_state_size),
    ngroups (n_groups), d_conv (conv_kernel); `A_log`, `D`, `dt_bias` are per Mamba head."""

    hybrid_override_pattern: str
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    mamba_hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_ssm_cache_dtype: str = "float32"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 0
    num_nextn_predict_layers: int = 0
    mtp_hybrid_override_pattern: str = "*-"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        parse_pattern(self.hybrid_override_pattern)
        if not self.hybrid_override_pattern:
            raise ConfigError("hybrid_override_pattern is empty: the model needs at least one layer")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "mamba_num_heads",
            "mamba_head_dim",
            "ssm_state_size",
            "n_groups",
            "conv_kernel",
            "chunk_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups ({self.n_groups})"
            )
        if self.conv_kernel < 2:
            raise ConfigError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.mlp_hidden_act not in MLP_ACTIVATIONS:
            raise ConfigError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not one of {MLP_ACTIVATIONS}")
        if self.mamba_hidden_act != "silu":
            raise ConfigError(f"mamba_hidden_act must be 'silu', got {self.mamba_hidden_act!r}")
        if not self.layer_norm_epsilon > 0:
            raise ConfigError(f"layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")
        if not 0 < self.time_step_min <= self.time_step_max:
            raise ConfigError(
                f"need 0 < time_step_min <= time_step_max, got {self.time_step_min}, {self.time_step_max}"
            )
        if self.mamba_ssm_cache_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"mamba_ssm_cache_dtype {self.mamba_ssm_cache_dtype!r} is not a float dtype")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"num_nextn_predict_layers must be 0 or 1, got {self.num_nextn_predict_layers}")
        if self.num_nextn_predict_layers:
            kinds = parse_pattern(self.mtp_hybrid_override_pattern, "mtp_hybrid_override_pattern")
            if LayerKind.MAMBA in kinds or not kinds:
                raise ConfigError(
                    "mtp_hybrid_override_pattern may hold only '*' and '-' layers, got "
                    f"{self.mtp_hybrid_override_pattern!r}"
                )

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return parse_pattern(self.hybrid_override_pattern)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.ATTENTION)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MAMBA)

    @property
    def mlp_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MLP)

    @property
    def mtp_layer_kinds(self) -> tuple[LayerKind, ...]:
        if not self.num_nextn_predict_layers:
            return ()
        return parse_pattern(self.mtp_hybrid_override_pattern, "mtp_hybrid_override_pattern")

    @property
    def mtp_attention_layer_ids(self) -> tuple[int, ...]:
        """Indices into the MTP head's layers that are attention (keys of ModelCaches.draft_kv)."""
        return tuple(i for i, k in enumerate(self.mtp_layer_kinds) if k is LayerKind.ATTENTION)

    @property
    def d_inner(self) -> int:
        """Mamba inner width: mamba_num_heads * mamba_head_dim (transformers ignores `expand`)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the depthwise conv: x, B and C, i.e. d_inner + 2 * ngroups * d_state."""
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        """in_proj output: gate z (d_inner) | xBC (conv_dim) | dt (nheads)."""
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    @property
    def dt_limit(self) -> tuple[float, float]:
        """Clamp applied to softplus(dt + dt_bias): transformers uses (time_step_min, inf)."""
        return (self.time_step_min, math.inf)

    # ---- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HybridModelConfig:
        """Parse a config.json / YAML mapping. Unknown fields are kept in `extra` (and written back)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"model config must be a mapping, got {type(raw).__name__}")
        data = dict(raw)
        model_type = data.pop("model_type", "nemotron_h")
        if model_type != "nemotron_h":
            raise ConfigError(f"model_type must be 'nemotron_h', got {model_type!r}")
        for old, new in _LEGACY_ALIASES.items():
            if old in data:
                data.setdefault(new, data.pop(old))
        if "hybrid_override_pattern" not in data:
            if "layers_block_type" not in data:
                raise ConfigError("config needs hybrid_override_pattern (or layers_block_type)")
            data["hybrid_override_pattern"] = _pattern_from_block_types(
                data["layers_block_type"], "layers_block_type"
            )
        if not isinstance(data["hybrid_override_pattern"], str):
            raise ConfigError(
                f"hybrid_override_pattern must be a string, got {data['hybrid_override_pattern']!r}"
            )
        data.pop("layers_block_type", None)
        if "mtp_layers_block_type" in data and "mtp_hybrid_override_pattern" not in data:
            data["mtp_hybrid_override_pattern"] = _pattern_from_block_types(
                data["mtp_layers_block_type"], "mtp_layers_block_type"
            )
        data.pop("mtp_layers_block_type", None)
        if data.get("num_nextn_predict_layers") is None:
            data["num_nextn_predict_layers"] = 0
        if "time_step_limit" in data:
            lo, hi = data["time_step_limit"]
            data["time_step_limit"] = (float(lo), float(hi))
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = sorted(
            f.name
            for f in fields(cls)
            if f.name in names
            and f.name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ConfigError(f"model config is missing required field(s): {', '.join(missing)}")
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        try:
            return cls(**known, extra=extra)
        except TypeError as exc:
            raise ConfigError(f"bad model config: {exc}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> HybridModelConfig:
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers' NemotronHForCausalLM loads (plus our MTP fields)."""
        out: dict[str, Any] = dict(self.extra)
        for f in fields(self):
            if f.name != "extra":
                out[f.name] = getattr(self, f.name)
        out.pop(
            "time_step_limit"
        )  # transformers ignores it (it clamps at time_step_min); avoids `Infinity` in JSON
        out["model_type"] = "nemotron_h"
        out["architectures"] = ["NemotronHForCausalLM"]
        out["num_hidden_layers"] = self.num_hidden_layers
        out["mamba_proj_bias"] = self.use_bias
        out["attention_bias"] = False
        if self.num_nextn_predict_layers:
            out["mtp_layers_block_type"] = [_CHAR_TO_BLOCK_TYPE[c] for c in self.mtp_hybrid_override_pattern]
        out.pop("mtp_hybrid_override_pattern")
        return out
