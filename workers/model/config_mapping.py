"""The one place that maps each architecture's config.json onto `HybridModelConfig` fields.

    nemotron_h        NemotronH v1 (8B/47B/56B: `attention_head_dim`), v2 (Nano 9B/12B), Nemotron 3 Nano (MoE)
                      and Super (latent MoE + MTP); transformers-5-saved files (`layers_block_type`,
                      `{"__float__": "Infinity"}`) and NVIDIA's originals (`hybrid_override_pattern`)
    granitemoehybrid  Granite-4.0-H micro / tiny / small: layer i -> blocks 2i (mixer) and 2i+1 (FFN:
                      shared MLP '-' or MoE + shared expert 'E'); multipliers; optional RoPE
    bamba             Bamba: layer i -> blocks 2i (mixer) and 2i+1 (gated MLP '-'); RoPE on part of the head

Every field of a config.json is accounted for: mapped, checked (a value that changes the math in a way we
do not run is a ConfigError naming the field), or listed in `_IGNORED` because transformers ignores it too
(or it only matters for training). An unknown field is a ConfigError naming it: never silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
_NEMOTRON_ALIASES = {
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
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where} must be a list of strings, got {types!r}")
    chars = []
    for i, t in enumerate(types):
        if t not in _BLOCK_TYPE_TO_CHAR:
            raise UnsupportedLayerError(i, t, where)
        chars.append(_BLOCK_TYPE_TO_CHAR[t])
    return "".join(chars)


def _time_step_limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"time_step_limit must be a pair [lo, hi], got {value!r}")
    try:
        return (float(value[0]), float(value[1]))
    except (TypeError, ValueError):
        raise ConfigError(f"time_step_limit must hold numbers, got {value!r}") from None


def _require(data: dict, name: str, allowed: tuple, why: str) -> None:
    if name in data and data[name] not in allowed:
        raise ConfigError(f"{name}={data[name]!r} is not supported ({why}); supported: {allowed}")


class _Fields:
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


def _nemotron_h(f: _Fields, field_names: set[str]) -> dict:
    d = f.data
    for old, new in _NEMOTRON_ALIASES.items():
        if old in d:
            d.setdefault(new, d.pop(old))
    _require(d, "sliding_window", (None,), "NemotronH attention is global")
    d.pop("sliding_window", None)
    if "attention_head_dim" in d:  # Nemotron-H v1 (8B / 47B / 56B)
        v1 = d.pop("attention_head_dim")
        if d.setdefault("head_dim", v1) != v1:
            raise ConfigError(f"attention_head_dim ({v1}) and head_dim ({d['head_dim']}) disagree")
    if "hybrid_override_pattern" not in d:
        if "layers_block_type" not in d:
            raise ConfigError("config needs hybrid_override_pattern (or layers_block_type)")
        d["hybrid_override_pattern"] = pattern_from_block_types(d["layers_block_type"], "layers_block_type")
    if not isinstance(d["hybrid_override_pattern"], str):
        raise ConfigError(f"hybrid_override_pattern must be a string, got {d['hybrid_override_pattern']!r}")
    d.pop("layers_block_type", None)
    if "mtp_layers_block_type" in d and "mtp_hybrid_override_pattern" not in d:
        types = d["mtp_layers_block_type"]
        if types is not None:
            d["mtp_hybrid_override_pattern"] = pattern_from_block_types(types, "mtp_layers_block_type")
    d.pop("mtp_layers_block_type", None)
    if d.get("num_nextn_predict_layers") is None:
        d["num_nextn_predict_layers"] = 0
    if "E" in d["hybrid_override_pattern"] or (d["num_nextn_predict_layers"] and "E" in d.get(
            "mtp_hybrid_override_pattern", "")):
        _require(d, "n_shared_experts", (1,), "transformers builds exactly one shared expert")
    limit = d.pop("time_step_limit", None)  # transformers clamps at time_step_min whatever this says
    if limit is not None:
        _time_step_limit(limit)
    if d.get("moe_latent_size") is None:
        d.pop("moe_latent_size", None)
    return f.finish({"model_type": "nemotron_h"}, field_names)


def _mamba_fields(f: _Fields) -> dict:
    """Granite / Bamba `mamba_*` fields -> ours; d_inner = mamba_expand * hidden_size must match heads."""
    hidden = f.data.get("hidden_size")
    heads = f.take("mamba_n_heads", 128)
    expand = f.take("mamba_expand", 2)
    head_dim = f.take("mamba_d_head", "auto")
    if head_dim == "auto" and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = expand * hidden // heads
    if isinstance(hidden, int) and isinstance(head_dim, int) and head_dim * heads != expand * hidden:
        raise ConfigError(f"mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must equal mamba_expand * "
                          f"hidden_size ({expand} * {hidden})")
    return {
        "mamba_num_heads": heads, "mamba_head_dim": head_dim, "n_groups": f.take("mamba_n_groups", 1),
        "ssm_state_size": f.take("mamba_d_state", 256), "conv_kernel": f.take("mamba_d_conv", 4),
        "chunk_size": f.take("mamba_chunk_size", 256), "use_conv_bias": f.take("mamba_conv_bias", True),
        "use_bias": f.take("mamba_proj_bias", False),
        "time_step_limit": _time_step_limit(f.take("time_step_limit", (0.0, math.inf))),
    }


def _attention_fields(f: _Fields, rope: dict | None) -> dict:
    d = f.data
    _require(d, "attention_bias", (False,), "attention projections with bias are not implemented")
    d.pop("attention_bias", None)
    heads = d.get("num_attention_heads", 32)
    kv = f.take("num_key_value_heads", None)
    hidden = d.get("hidden_size")
    out = {"num_key_value_heads": heads if kv is None else kv}
    if "head_dim" not in d and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        out["head_dim"] = hidden // heads
    if rope is not None:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        head_dim = d.get("head_dim", out.get("head_dim"))
        out["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        out["rotary_dim"] = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    return out


def _rope(d: dict) -> dict:
    """rope_parameters (transformers >= 5) or the older top-level rope_theta / rope_scaling."""
    if d.get("rope_scaling") is not None:
        raise ConfigError(f"rope_scaling={d['rope_scaling']!r} is not supported (only unscaled RoPE)")
    rope = dict(d.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in d:
        rope["rope_theta"] = d["rope_theta"]
    return rope


def _common_fields(f: _Fields) -> dict:
    _require(f.data, "normalization_function", ("rmsnorm",), "every norm is an RMSNorm")
    act = f.take("hidden_act", "silu")
    if act != "silu":  # also the Mamba conv activation in these architectures
        raise ConfigError(f"hidden_act={act!r} is not supported (Mamba layers and gated MLPs use 'silu')")
    return {"mlp_hidden_act": "silu", "mamba_hidden_act": "silu", "mlp_gated": True,
            "layer_norm_epsilon": f.take("rms_norm_eps", 1e-6)}


def _granite(f: _Fields, field_names: set[str]) -> dict:
    d = f.data
    types = d.pop("layer_types", d.pop("layers_block_type", None))
    if types is None:
        types = ["linear_attention"] * int(d.get("num_hidden_layers", 0))
    mixers = pattern_from_block_types(types, "layer_types")
    if set(mixers) - {"M", "*"}:
        raise ConfigError(f"layer_types may hold only mamba / attention layers, got {types!r}")
    num_experts = f.take("num_local_experts", 8) or 0
    ffn = "E" if num_experts > 0 else "-"
    rope = _rope(d) if d.get("position_embedding_type") == "rope" else None
    _require(d, "position_embedding_type", (None, "nope", "rope"), "positional embedding")
    shared = f.take("shared_intermediate_size", 1024)
    expert_size = f.take("intermediate_size", 11008)
    out = {
        "model_type": "granitemoehybrid",
        "hybrid_override_pattern": "".join(m + ffn for m in mixers),
        "intermediate_size": shared,
        **_common_fields(f), **_mamba_fields(f), **_attention_fields(f, rope),
        "embedding_multiplier": float(f.take("embedding_multiplier", 1.0)),
        "residual_multiplier": float(f.take("residual_multiplier", 1.0)),
        "attention_multiplier": float(f.take("attention_multiplier", 1.0)),
        "logits_scaling": float(f.take("logits_scaling", 1.0)),
        "pad_token_id": f.take("pad_token_id", None),
    }
    if num_experts:
        out.update(n_routed_experts=num_experts, num_experts_per_tok=f.take("num_experts_per_tok", 2),
                   moe_intermediate_size=expert_size, moe_shared_expert_intermediate_size=shared,
                   moe_router="softmax_topk", norm_topk_prob=False)
    else:
        f.take("num_experts_per_tok")
    return f.finish(out, field_names)


def _bamba(f: _Fields, field_names: set[str]) -> dict:
    d = f.data
    num_layers = int(d.get("num_hidden_layers", 32))
    attn = set(f.take("attn_layer_indices", None) or ())
    rope = _rope(d)
    rope.setdefault("partial_rotary_factor", 0.5)  # transformers hard-codes it for Bamba
    head_dim = d.get("head_dim") or d.get("hidden_size", 4096) // d.get("num_attention_heads", 32)
    if "attn_rotary_emb" in d and d["attn_rotary_emb"] != int(head_dim * rope["partial_rotary_factor"]):
        raise ConfigError(f"attn_rotary_emb={d['attn_rotary_emb']} differs from the rotary width transformers "
                          f"uses ({int(head_dim * rope['partial_rotary_factor'])} of head_dim {head_dim})")
    out = {
        "model_type": "bamba",
        "hybrid_override_pattern": "".join(("*" if i in attn else "M") + "-" for i in range(num_layers)),
        **_common_fields(f), **_mamba_fields(f), **_attention_fields(f, rope),
    }
    return f.finish(out, field_names)


_MAPPERS: dict[str, Callable[[_Fields, set[str]], dict]] = {
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite,
    "bamba": _bamba,
}


def map_config(raw: Mapping[str, Any], field_names: set[str]) -> dict:
    """config.json mapping -> keyword arguments of HybridModelConfig (still to be validated by it)."""

    if not isinstance(raw, Mapping):
        raise ConfigError(f"model config must be a mapping, got {type(raw).__name__}")
    data = decode_json_floats(dict(raw))
    model_type = data.pop("model_type", "nemotron_h")
    if model_type not in _MAPPERS:
        raise ConfigError(f"model_type must be one of {', '.join(_MAPPERS)}, got {model_type!r}")
    fields_ = _Fields(data, model_type)
    out = _MAPPERS[model_type](fields_, field_names)
    if isinstance(out.get("time_step_limit"), list):
        out["time_step_limit"] = _time_step_limit(out["time_step_limit"])
    eos = out.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ConfigError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        out["eos_token_id"] = tuple(eos)
    missing = sorted(n for n in _REQUIRED if n not in out)
    if missing:
        raise ConfigError(f"model config is missing required field(s): {', '.join(missing)}")
    return out


_REQUIRED = ("hybrid_override_pattern", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups")
