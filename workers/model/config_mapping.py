"""The one place that maps each architecture's config.json onto `HybridModelConfig` fields.

    nemotron_h        NemotronH v1 (8B/47B/56B: `attention_head_dim`), v2 (Nano 9B/12B), Nemotron 3 Nano (MoE)
                      and Super (latent MoE + MTP); transformers-5-saved files (`layers_block_type`,
                      `{"__float__": "Infinity"}`) and NVIDIA's originals (`hybrid_override_pattern`)
    granitemoehybrid  Granite-4.0-H micro / tiny / small: layer i -> blocks 2i (mixer) and 2i+1 (FFN:
                      shared MLP '-' or MoE + shared expert 'E'); multipliers; optional RoPE
    bamba             Bamba: layer i -> blocks 2i (mixer) and 2i+1 (gated MLP '-'); RoPE on part of the head

Every field of a config.json is accounted for: mapped, checked (a value that changes the math in a way we
do not run is a ConfigError naming the field), or ignored because transformers ignores it too (or it only
matters for training: `config_fields.py`). An unknown field is a ConfigError naming it: never silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from workers.model.config_fields import (
    ConfigFields,
    decode_json_floats,
    pattern_from_block_types,
    require_allowed,
    time_step_limit,
)
from workers.model.errors import ConfigError

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


def _nemotron_h(f: ConfigFields, field_names: set[str]) -> dict:
    d = f.data
    for old, new in _NEMOTRON_ALIASES.items():
        if old in d:
            d.setdefault(new, d.pop(old))
    require_allowed(d, "sliding_window", (None,), "NemotronH attention is global")
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
        require_allowed(d, "n_shared_experts", (1,), "transformers builds exactly one shared expert")
    limit = d.pop("time_step_limit", None)  # transformers clamps at time_step_min whatever this says
    if limit is not None:
        time_step_limit(limit)
    if d.get("moe_latent_size") is None:
        d.pop("moe_latent_size", None)
    return f.finish({"model_type": "nemotron_h"}, field_names)


def _mamba_fields(f: ConfigFields) -> dict:
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
        "time_step_limit": time_step_limit(f.take("time_step_limit", (0.0, math.inf))),
    }


def _attention_fields(f: ConfigFields, rope: dict | None) -> dict:
    d = f.data
    require_allowed(d, "attention_bias", (False,), "attention projections with bias are not implemented")
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


def _common_fields(f: ConfigFields) -> dict:
    require_allowed(f.data, "normalization_function", ("rmsnorm",), "every norm is an RMSNorm")
    act = f.take("hidden_act", "silu")
    if act != "silu":  # also the Mamba conv activation in these architectures
        raise ConfigError(f"hidden_act={act!r} is not supported (Mamba layers and gated MLPs use 'silu')")
    return {"mlp_hidden_act": "silu", "mamba_hidden_act": "silu", "mlp_gated": True,
            "layer_norm_epsilon": f.take("rms_norm_eps", 1e-6)}


def _granite(f: ConfigFields, field_names: set[str]) -> dict:
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
    require_allowed(d, "position_embedding_type", (None, "nope", "rope"), "positional embedding")
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


def _bamba(f: ConfigFields, field_names: set[str]) -> dict:
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


_MAPPERS: dict[str, Callable[[ConfigFields, set[str]], dict]] = {
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
    fields_ = ConfigFields(data, model_type)
    out = _MAPPERS[model_type](fields_, field_names)
    if isinstance(out.get("time_step_limit"), list):
        out["time_step_limit"] = time_step_limit(out["time_step_limit"])
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
