"""Checkpoints built at test time by transformers from configs that mirror real models' config.json,
scaled down to tiny sizes (the layer-kind mix, routing, multipliers and format quirks kept).

    id                source model (config.json mirrored)               format quirk exercised
    nemotron_h_v1     nvidia/Nemotron-H-8B-Base-8K                       attention_head_dim, hybrid_override_pattern,
                                                                         bare `Infinity` in time_step_limit
    nemotron_h_v2     nvidia/NVIDIA-Nemotron-Nano-9B-v2                  list eos_token_id, mamba_head_dim 80-like
    nemotron_h_t5     any NemotronH saved by transformers 5.24            layers_block_type, {"__float__": "Infinity"}
    nemotron3_nano    nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16          MoE 'E': sigmoid routing, n_group/topk_group,
                                                                         routed_scaling_factor, shared expert; the
                                                                         published file's exact field set
                                                                         (norm_eps, partial_rotary_factor, rope_theta,
                                                                         hybrid_override_pattern, no time_step_limit)
    nemotron3_super   Nemotron 3 Super (latent MoE + MTP '*E')           moe_latent_size, mtp.* in vLLM's format; the
                                                                         Nano field set + mtp_hybrid_override_pattern
    granite_h_tiny    ibm-granite/granite-4.0-h-tiny                     MoE + shared expert, multipliers, no RoPE
    granite_h_micro   ibm-granite/granite-4.0-h-micro                    dense shared MLP only
    granite_h_rope    granite-4.0-h-micro with position_embedding_type   full RoPE (a config option no published
                      "rope" (rope_parameters)                           Granite-4.0-H uses)
    bamba             ibm-ai-platform/Bamba-9B-v2                        RoPE on half of each head

Weights are seeded and scaled so logits are far from degenerate (transformers' own init at these sizes
gives near-constant logits, which would make parity prove nothing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

NEMOTRON_COMMON = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mlp_hidden_act="relu2", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
    n_groups=2, conv_kernel=4, chunk_size=16, use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5,
    time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
NEMOTRON3_MOE = dict(
    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
)
# The field set of the published nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json, with its values.
# A tiny checkpoint's file gets exactly these keys: the sizes transformers saved for the tiny model where
# it saved the key, the published value otherwise (the fields transformers 5 does not write).
NEMOTRON3_NANO_PUBLISHED = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "head_dim": 128,
    "hidden_dropout": 0.0, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02, "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 64, "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h",
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2,
    "num_logits_to_keep": 1, "pad_token_id": 0, "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True,
    "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_max": 0.1,
    "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.55.4",
    "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072,
}
# Nemotron 3 Super (120B-A12B) adds its latent MoE width and the MTP layer's pattern to the same fields.
NEMOTRON3_SUPER_PUBLISHED = {**NEMOTRON3_NANO_PUBLISHED, "moe_latent_size": 1024, "num_nextn_predict_layers": 1,
                             "mtp_hybrid_override_pattern": "*E", "eos_token_id": [2, 11]}
GRANITE_COMMON = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
    rms_norm_eps=1e-5, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False,
    position_embedding_type="nope", tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
)

SPECS: dict[str, dict] = {
    "nemotron_h_v1": dict(model_type="nemotron_h", hybrid_override_pattern="M-M*-M-", **NEMOTRON_COMMON),
    "nemotron_h_v2": dict(model_type="nemotron_h", hybrid_override_pattern="M-M-M*-M-",
                          **{**NEMOTRON_COMMON, "eos_token_id": [2, 11], "mamba_head_dim": 20}),
    "nemotron_h_t5": dict(model_type="nemotron_h", hybrid_override_pattern="M*M-M-", **NEMOTRON_COMMON),
    "nemotron3_nano": dict(model_type="nemotron_h", hybrid_override_pattern="MEM*EME", **NEMOTRON_COMMON,
                           **NEMOTRON3_MOE),
    "nemotron3_super": dict(model_type="nemotron_h", hybrid_override_pattern="MEM*EME", **NEMOTRON_COMMON,
                            **NEMOTRON3_MOE, moe_latent_size=32, num_nextn_predict_layers=1,
                            mtp_layers_block_type=["full_attention", "moe"]),
    "granite_h_tiny": dict(model_type="granitemoehybrid", num_hidden_layers=4,
                           layer_types=["mamba", "mamba", "attention", "mamba"], intermediate_size=32,
                           shared_intermediate_size=48, num_local_experts=8, num_experts_per_tok=3,
                           **GRANITE_COMMON),
    "granite_h_micro": dict(model_type="granitemoehybrid", num_hidden_layers=4,
                            layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=32,
                            shared_intermediate_size=96, num_local_experts=0, num_experts_per_tok=0,
                            **GRANITE_COMMON),
    "granite_h_rope": dict(model_type="granitemoehybrid", num_hidden_layers=3,
                           layer_types=["mamba", "attention", "mamba"], intermediate_size=32,
                           shared_intermediate_size=96, num_local_experts=0, num_experts_per_tok=0,
                           **{**GRANITE_COMMON, "position_embedding_type": "rope"},
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "bamba": dict(model_type="bamba", vocab_size=256, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[2],
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, hidden_act="silu",
                  rms_norm_eps=1e-5, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, rope_parameters={
                      "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
}
MOE_IDS = ("nemotron3_nano", "nemotron3_super", "granite_h_tiny")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():  # transformers keeps the routing bias as a buffer
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts win
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")) or "conv1d" in name:
                continue  # transformers' init of these is already meaningful
            if name.endswith("bias"):
                value = torch.zeros(p.shape)
            elif p.dim() == 1:
                value = 1.0 + torch.randn(p.shape, generator=g) * 0.1
            elif "embed" in name:
                value = torch.randn(p.shape, generator=g)
            else:  # [out, in] or experts [E, out, in]
                value = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(value)


def _nemotron_hf_kwargs(spec: dict) -> dict:
    kw = {k: v for k, v in spec.items() if k != "model_type"}
    kw["layers_block_type"] = [
        {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c]
        for c in kw.pop("hybrid_override_pattern")
    ]
    return kw


def _add_mtp(out: Path, spec: dict, seed: int) -> None:
    """Append an MTP head in vLLM's NemotronH checkpoint format (transformers neither builds nor saves
    one): mtp.layers.0 = attention with enorm/hnorm/eh_proj; mtp.layers.1 = MoE (per-expert tensors) with
    final_layernorm."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed + 100)
    H, kv, hd = spec["hidden_size"], spec["num_key_value_heads"], spec["head_dim"]
    E, inter, shared = spec["n_routed_experts"], spec["moe_intermediate_size"], spec[
        "moe_shared_expert_intermediate_size"]
    width = spec.get("moe_latent_size") or H

    def lin(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    def norm():
        return 1.0 + torch.randn(H, generator=g) * 0.1

    t = {"mtp.layers.0.enorm.weight": norm(), "mtp.layers.0.hnorm.weight": norm(),
         "mtp.layers.0.eh_proj.weight": lin(H, 2 * H), "mtp.layers.0.norm.weight": norm(),
         "mtp.layers.0.mixer.q_proj.weight": lin(spec["num_attention_heads"] * hd, H),
         "mtp.layers.0.mixer.k_proj.weight": lin(kv * hd, H), "mtp.layers.0.mixer.v_proj.weight": lin(kv * hd, H),
         "mtp.layers.0.mixer.o_proj.weight": lin(H, spec["num_attention_heads"] * hd),
         "mtp.layers.1.norm.weight": norm(), "mtp.layers.1.final_layernorm.weight": norm(),
         "mtp.layers.1.mixer.gate.weight": lin(E, H),
         "mtp.layers.1.mixer.gate.e_score_correction_bias": torch.randn(E, generator=g) * 0.5,
         "mtp.layers.1.mixer.shared_experts.up_proj.weight": lin(shared, H),
         "mtp.layers.1.mixer.shared_experts.down_proj.weight": lin(H, shared)}
    if spec.get("moe_latent_size"):
        t["mtp.layers.1.mixer.fc1_latent_proj.weight"] = lin(width, H)
        t["mtp.layers.1.mixer.fc2_latent_proj.weight"] = lin(H, width)
    for e in range(E):
        t[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] = lin(inter, width)
        t[f"mtp.layers.1.mixer.experts.{e}.down_proj.weight"] = lin(width, inter)
    save_file(t, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})


def _rewrite_config(out: Path, model_id: str, spec: dict) -> None:
    """Give config.json the shape of the real model's file where it differs from transformers' save."""
    path = out / "config.json"
    if model_id == "nemotron_h_v1":  # NVIDIA's v1 file: attention_head_dim, pattern string, bare Infinity
        cfg = json.loads(path.read_text())
        cfg["attention_head_dim"] = cfg.pop("head_dim")
        cfg.pop("layers_block_type")
        cfg["hybrid_override_pattern"] = spec["hybrid_override_pattern"]
        cfg["num_hidden_layers"] = len(spec["hybrid_override_pattern"])
        cfg["time_step_limit"] = [0.0, math.inf]
        cfg["rms_norm_eps"] = 1e-5
        path.write_text(json.dumps(cfg, indent=2))  # json writes `Infinity`, as NVIDIA's file has
    elif model_id == "nemotron_h_v2":  # NVIDIA's v2 file: pattern string, mtp fields absent
        cfg = json.loads(path.read_text())
        cfg.pop("layers_block_type")
        cfg["hybrid_override_pattern"] = spec["hybrid_override_pattern"]
        for k in ("mtp_layers_block_type", "num_nextn_predict_layers"):
            cfg.pop(k, None)
        path.write_text(json.dumps(cfg, indent=2))
    elif model_id in ("nemotron3_nano", "nemotron3_super"):  # the published file's exact field set
        published = NEMOTRON3_NANO_PUBLISHED if model_id == "nemotron3_nano" else NEMOTRON3_SUPER_PUBLISHED
        saved = json.loads(path.read_text())
        cfg = {k: saved.get(k, v) for k, v in published.items()}
        cfg["hybrid_override_pattern"] = spec["hybrid_override_pattern"]
        cfg["num_hidden_layers"] = len(spec["hybrid_override_pattern"])
        if "mtp_hybrid_override_pattern" in cfg:
            cfg["mtp_hybrid_override_pattern"] = pattern_of(spec["mtp_layers_block_type"])
        path.write_text(json.dumps(cfg, indent=2))


def pattern_of(block_types: list[str]) -> str:
    return "".join({"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                    "moe": "E"}[t] for t in block_types)


def hf_config(model_id: str):
    import transformers

    spec = SPECS[model_id]
    kind = spec["model_type"]
    if kind == "nemotron_h":
        return transformers.NemotronHConfig(**_nemotron_hf_kwargs(spec))
    kw = {k: v for k, v in spec.items() if k != "model_type"}
    if kind == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(**kw)
    return transformers.BambaConfig(**kw)


def build(model_id: str, out: Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint of `model_id` (transformers' save_pretrained + format edits) into out."""
    import transformers

    spec = SPECS[model_id]
    config = hf_config(model_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out)
    _rewrite_config(out, model_id, spec)
    if spec.get("num_nextn_predict_layers"):
        _add_mtp(out, spec, seed)
    return out


def load_hf(model_id: str, path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model on the same weights (its config object: transformers 5 cannot read the v1
    `attention_head_dim` file by itself)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, config=hf_config(model_id), dtype=dtype).eval()
