"""config.json's fields as `config_mapping.py` consumes them: which each architecture ignores (as
transformers does, or because they only matter for training) or passes through to `HybridModelConfig`
under its own name, and `ConfigFields`, which hands them out to an architecture's mapper and refuses
whatever is left (an unknown field is a ConfigError naming it: never silently dropped); plus the
field decoders the mappers share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from workers.model.errors import ConfigError, UnsupportedLayerError

_BLOCK_TYPE_TO_CHAR = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
# Our own fields that are not NemotronH config.json fields (written only when not neutral).
NOT_NEMOTRON_FIELDS = ("mlp_gated", "attention_multiplier", "rope_theta", "rotary_dim", "embedding_multiplier",
                           "residual_multiplier", "logits_scaling", "moe_router")
# No effect on inference logits (bookkeeping, training-only, or ignored by transformers' model code).
_COMMON_IGNORED = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "_name_or_path", "auto_map",
    "num_logits_to_keep", "attention_dropout", "hidden_dropout", "output_router_logits", "router_aux_loss_coef",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "tokenizer_class", "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "torchscript",
    "pruned_heads", "tie_encoder_decoder", "add_cross_attention",
})
_IGNORED = {
    # transformers' NemotronH ignores these: bias-free attention, d_inner = heads * head_dim, in_proj bias
    # from use_bias, residuals in the model dtype, one shared expert, eps from layer_norm_epsilon.
    "nemotron_h": _COMMON_IGNORED | {
        "attention_bias", "expand", "mamba_proj_bias", "residual_in_fp32", "rescale_prenorm_residual",
        "use_mamba_kernels", "moe_shared_expert_overlap", "time_step_rank", "rms_norm_eps", "num_hidden_layers",
        "n_shared_experts", "time_step_limit",
        # NemotronH attention has no positional embedding: transformers' NemotronHAttention and vLLM's
        # nemotron_h.py apply no rotary, so the RoPE fields of the published Nemotron 3 files (Nano 30B-A3B,
        # Super 120B-A12B: rope_theta 10000, partial_rotary_factor 1.0) change nothing.
        "rope_theta", "partial_rotary_factor",
        # Nemotron 3's files carry norm_eps beside layer_norm_epsilon (both 1e-5); every norm in transformers
        # and vLLM reads layer_norm_epsilon only, so we do too (norm_eps is never read by either).
        "norm_eps",
    },
    # init_method (mup) and embedding_dropout only matter in training; RoPE fields unused without RoPE.
    "granitemoehybrid": _COMMON_IGNORED | {"num_hidden_layers", "position_embedding_type", "rope_parameters",
                                           "rope_theta", "rope_scaling", "init_method", "embedding_dropout",
                                           "normalization_function"},
    "bamba": _COMMON_IGNORED | {"z_loss_coefficient", "num_hidden_layers", "rope_parameters", "rope_theta",
                                "rope_scaling", "use_mamba_kernels", "attn_rotary_emb"},
}


_SHARED = frozenset({"vocab_size", "hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings",
                     "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                     "mamba_ssm_cache_dtype"})
# config.json fields that reach HybridModelConfig under their own name (the rest are mapped explicitly).
_PASSTHROUGH = {
    "nemotron_h": None,  # every HybridModelConfig field except our own non-NemotronH ones
    "granitemoehybrid": _SHARED,
    "bamba": _SHARED | {"mlp_bias", "intermediate_size"},
}


def decode_json_floats(value: Any) -> Any:
    """transformers >= 5 writes non-finite floats as {"__float__": "Infinity"}; turn them back into floats."""
    if isinstance(value, Mapping):
        if set(value) == {"__float__"}:
            try:
                return float(value["__float__"])
            except (TypeError, ValueError):
                raise ConfigError(f"bad encoded float {dict(value)!r}") from None
        return {k: decode_json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_floats(v) for v in value]
    return value


def pattern_from_block_types(types: Any, where: str) -> str:
    """A list of layer type names (`layers_block_type`, `layer_types`) as a `hybrid_override_pattern`."""
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where} must be a list of strings, got {types!r}")
    chars = []
    for i, t in enumerate(types):
        if t not in _BLOCK_TYPE_TO_CHAR:
            raise UnsupportedLayerError(i, t, where)
        chars.append(_BLOCK_TYPE_TO_CHAR[t])
    return "".join(chars)


def time_step_limit(value: Any) -> tuple[float, float]:
    """A config's `time_step_limit` as (lo, hi); None: unlimited."""
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"time_step_limit must be a pair [lo, hi], got {value!r}")
    try:
        return (float(value[0]), float(value[1]))
    except (TypeError, ValueError):
        raise ConfigError(f"time_step_limit must hold numbers, got {value!r}") from None


def require_allowed(data: dict, name: str, allowed: tuple, why: str) -> None:
    """A ConfigError unless field `name` is absent or one of `allowed` (`why`: what we do not run)."""
    if name in data and data[name] not in allowed:
        raise ConfigError(f"{name}={data[name]!r} is not supported ({why}); supported: {allowed}")


class ConfigFields:
    """Consumes config.json fields; whatever is left at the end is unknown and refused."""

    def __init__(self, data: dict, model_type: str) -> None:
        self.data, self.model_type = data, model_type

    def take(self, name: str, default: Any = None) -> Any:
        return self.data.pop(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def finish(self, out: dict, field_names: set[str]) -> dict:
        for name in _IGNORED[self.model_type]:
            self.data.pop(name, None)
        passthrough = _PASSTHROUGH[self.model_type]
        if passthrough is None:
            passthrough = field_names - set(NOT_NEMOTRON_FIELDS) - {"model_type"}
        unknown = sorted(set(self.data) - (field_names & passthrough))
        if unknown:
            raise ConfigError(
                f"unknown {self.model_type} config field(s) {', '.join(unknown)}: hybridserve does not know "
                "whether they change the model's math, so it refuses to guess"
            )
        out.update(self.data)
        return out
