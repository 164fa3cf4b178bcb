"""`HybridModelConfig`: the config fields we run, validated, with derived sizes.

Field names are the transformers `NemotronHConfig` names. The layer pattern is kept as the
`hybrid_override_pattern` string (`M` Mamba2, `*` attention, `-` MLP, `E` MoE). GraniteMoeHybrid and
Bamba configs are mapped onto the same fields by `config_mapping.py` (the one place that reads each
architecture's config.json): each of their decoder layers becomes two blocks, mixer then FFN.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from workers.model.config_fields import NOT_NEMOTRON_FIELDS
from workers.model.config_mapping import map_config
from workers.model.errors import ConfigError, MissingFileError, UnsupportedLayerError


class LayerKind(str, enum.Enum):
    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"


_CHAR_TO_BLOCK_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MLP_ACTIVATIONS = ("relu2", "silu", "gelu", "relu")
MODEL_TYPES = ("nemotron_h", "granitemoehybrid", "bamba")


def parse_pattern(pattern: str, where: str = "hybrid_override_pattern") -> tuple[LayerKind, ...]:
    """'M-M*' -> (MAMBA, MLP, MAMBA, ATTENTION); any other char raises UnsupportedLayerError(index, char)."""
    kinds = []
    for i, char in enumerate(pattern):
        try:
            kinds.append(LayerKind(char))
        except ValueError:
            raise UnsupportedLayerError(i, char, where) from None
    return tuple(kinds)


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
    model_type: str = "nemotron_h"
    # MoE ('E' blocks): routed experts + one shared expert
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    moe_router: str = "sigmoid_group"  # NemotronH: sigmoid + group top-k; Granite: "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # FFN and attention variants (Granite / Bamba)
    mlp_gated: bool = False  # down(act(gate(x)) * up(x)) instead of down(act(up(x)))
    attention_multiplier: float | None = None  # softmax scale; None: head_dim ** -0.5
    rope_theta: float | None = None  # None: no positional embedding (NemotronH, Granite-4.0-H)
    rotary_dim: int = 0  # leading head dims rotated (Bamba: head_dim / 2)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        parse_pattern(self.hybrid_override_pattern)
        if not self.hybrid_override_pattern:
            raise ConfigError("hybrid_override_pattern is empty: the model needs at least one layer")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                     "conv_kernel", "chunk_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups "
                              f"({self.n_groups})")
        if self.conv_kernel < 2:
            raise ConfigError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.mlp_hidden_act not in MLP_ACTIVATIONS:
            raise ConfigError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not one of {MLP_ACTIVATIONS}")
        if self.mamba_hidden_act != "silu":
            raise ConfigError(f"mamba_hidden_act must be 'silu', got {self.mamba_hidden_act!r}")
        if not self.layer_norm_epsilon > 0:
            raise ConfigError(f"layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")
        if not 0 < self.time_step_min <= self.time_step_max:
            raise ConfigError(f"need 0 < time_step_min <= time_step_max, got {self.time_step_min}, "
                              f"{self.time_step_max}")
        if self.mamba_ssm_cache_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"mamba_ssm_cache_dtype {self.mamba_ssm_cache_dtype!r} is not a float dtype")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"num_nextn_predict_layers must be 0 or 1, got {self.num_nextn_predict_layers}")
        if self.num_nextn_predict_layers:
            kinds = parse_pattern(self.mtp_hybrid_override_pattern, "mtp_hybrid_override_pattern")
            if LayerKind.MAMBA in kinds or not kinds:
                raise ConfigError("mtp_hybrid_override_pattern may hold only '*', '-' and 'E' layers, got "
                                  f"{self.mtp_hybrid_override_pattern!r}")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        lo, hi = self.time_step_limit
        if not 0 <= lo < hi:
            raise ConfigError(f"time_step_limit must be (lo, hi) with 0 <= lo < hi, got {self.time_step_limit}")
        self._validate_moe()
        if self.rope_theta is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")

    def _validate_moe(self) -> None:
        if LayerKind.MOE not in set(self.layer_kinds) | set(self.mtp_layer_kinds):
            return
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer for MoE ('E') layers, got {value!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) > n_routed_experts "
                              f"({self.n_routed_experts})")
        if self.moe_router not in ("sigmoid_group", "softmax_topk"):
            raise ConfigError(f"moe_router must be sigmoid_group or softmax_topk, got {self.moe_router!r}")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts}) "
                              f"and topk_group ({self.topk_group}) must be <= n_group")
        if self.moe_router == "sigmoid_group" and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("n_routed_experts / n_group must be >= 2 (group score = sum of its top-2 experts)")
        if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
            raise ConfigError(f"topk_group ({self.topk_group}) groups hold fewer experts than "
                              f"num_experts_per_tok ({self.num_experts_per_tok})")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            raise ConfigError(f"moe_latent_size must be a positive integer or null, got {self.moe_latent_size!r}")
        if self.mlp_bias:
            raise ConfigError("mlp_bias: true is not supported with MoE ('E') layers")

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
    def eos_token_ids(self) -> frozenset[int]:
        """eos_token_id as a set (config.json may hold an int, a list or null)."""
        eos = self.eos_token_id
        return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MOE)

    @property
    def moe_input_size(self) -> int:
        """Width the routed experts see: moe_latent_size (latent MoE) or hidden_size."""
        return self.moe_latent_size or self.hidden_size

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

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
        """Clamp applied to softplus(dt + dt_bias): transformers' NemotronH uses (time_step_min, inf)
        whatever time_step_limit says; Granite and Bamba use time_step_limit."""
        if self.model_type == "nemotron_h":
            return (self.time_step_min, math.inf)
        return self.time_step_limit

    # ---- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HybridModelConfig:
        """Parse a config.json / YAML mapping of any supported architecture (see config_mapping.py):
        unknown fields and values that change the math in ways we do not run are a ConfigError naming
        the field."""
        try:
            return cls(**map_config(raw, {f.name for f in fields(cls)}))
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
        if self.model_type != "nemotron_h":
            raise ConfigError(f"to_hf_dict writes NemotronH configs only, not {self.model_type!r}")
        defaults = HybridModelConfig.__dataclass_fields__
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in NOT_NEMOTRON_FIELDS and value == defaults[f.name].default:
                continue  # a non-NemotronH field at its neutral value: not a config.json field
            out[f.name] = value
        out.pop("time_step_limit")  # transformers ignores it (it clamps at time_step_min); no `Infinity`
        out["model_type"] = "nemotron_h"
        out["architectures"] = ["NemotronHForCausalLM"]
        out["num_hidden_layers"] = self.num_hidden_layers
        out["mamba_proj_bias"] = self.use_bias
        out["attention_bias"] = False
        if self.num_nextn_predict_layers:
            out["mtp_layers_block_type"] = [_CHAR_TO_BLOCK_TYPE[c] for c in self.mtp_hybrid_override_pattern]
        out.pop("mtp_hybrid_override_pattern")
        if not set(self.layer_kinds) & {LayerKind.MOE} and LayerKind.MOE not in self.mtp_layer_kinds:
            for name in _MOE_FIELDS:
                out.pop(name, None)
        return out


_MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
               "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group",
               "routed_scaling_factor", "norm_topk_prob")
