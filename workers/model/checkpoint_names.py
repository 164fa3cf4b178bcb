"""Checkpoint tensor names -> our parameter names, per architecture (the loader's rename table).

Each checkpoint tensor becomes one or more `Piece`s of our parameters:

    nemotron_h  backbone.* -> model.* (NVIDIA's and transformers-5-saved files)
                {model,mtp}.layers.{i}.mixer.experts.{e}.{up,down}_proj.weight  -> ...experts.{up,down}_proj[e]
                (per-expert tensors are stacked; transformers' in-memory 3-D `experts.up_proj` loads as is)
                mtp.layers.{j}.*  the MTP head in the format vLLM's NemotronHMTP loads (enorm, hnorm,
                eh_proj on layer 0, final_layernorm on the last)
    granitemoehybrid / bamba: layer i -> our blocks 2i (mixer) and 2i+1 (FFN)
                model.embed_tokens -> model.embeddings;  model.norm / model.final_layernorm -> model.norm_f
                layers.{i}.input_layernorm -> layers.{2i}.norm;  {mamba,self_attn}.* -> layers.{2i}.mixer.*
                layers.{i}.{post_attention,pre_ff}_layernorm -> layers.{2i+1}.norm
                feed_forward.* (Bamba) -> layers.{2i+1}.mixer.*
                shared_mlp.input_linear [2I, H] -> gate_proj = rows [0, I), up_proj = rows [I, 2I)
                shared_mlp.output_linear -> down_proj  (under mixer.shared_experts when the layer has MoE)
                block_sparse_moe.input_linear [E, 2I, H] (or experts.gate_up_proj) -> experts.gate_proj | up_proj
                block_sparse_moe.output_linear (or experts.down_proj) -> experts.down_proj
                block_sparse_moe.router.layer.weight (or router.weight) -> gate.weight
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from workers.model.config import HybridModelConfig, LayerKind


@dataclass(frozen=True)
class Piece:
    """Part of parameter `target` held by checkpoint tensor `source`: the whole of it, expert `expert`
    of a stacked [E, ...] parameter, or chunk `part` of `num_parts` along dim `split_dim` of the source."""

    target: str
    source: str
    expert: int | None = None
    split_dim: int | None = None
    part: int = 0
    num_parts: int = 1


_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _nemotron_h(source: str, config: HybridModelConfig) -> list[Piece]:
    name = "model." + source[len("backbone.") :] if source.startswith("backbone.") else source
    m = _EXPERT.match(name)
    if m:
        return [Piece(f"{m[1]}.{m[3]}_proj", source, expert=int(m[2]))]
    return [Piece(name, source)]


def _ffn_prefix(config: HybridModelConfig, block: int) -> str:
    moe = config.layer_kinds[block] is LayerKind.MOE
    return f"model.layers.{block}.mixer" + (".shared_experts" if moe else "")


def _granite_or_bamba(source: str, config: HybridModelConfig) -> list[Piece]:
    top = {
        "model.embed_tokens.weight": "model.embeddings.weight",
        "model.norm.weight": "model.norm_f.weight",
        "model.final_layernorm.weight": "model.norm_f.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if source in top:
        return [Piece(top[source], source)]
    m = _LAYER.match(source)
    if not m:
        return []
    i, rest = int(m[1]), m[2]
    mixer, ffn = 2 * i, 2 * i + 1
    if rest == "input_layernorm.weight":
        return [Piece(f"model.layers.{mixer}.norm.weight", source)]
    if rest in ("post_attention_layernorm.weight", "pre_ff_layernorm.weight"):
        return [Piece(f"model.layers.{ffn}.norm.weight", source)]
    for sub in ("mamba.", "self_attn."):
        if rest.startswith(sub):
            return [Piece(f"model.layers.{mixer}.mixer.{rest[len(sub):]}", source)]
    if rest.startswith("feed_forward."):
        return [Piece(f"model.layers.{ffn}.mixer.{rest[len('feed_forward.'):]}", source)]
    if ffn >= config.num_hidden_layers:
        return []
    shared = _ffn_prefix(config, ffn)
    moe = f"model.layers.{ffn}.mixer"
    if rest == "shared_mlp.input_linear.weight":
        return [Piece(f"{shared}.gate_proj.weight", source, split_dim=0, part=0, num_parts=2),
                Piece(f"{shared}.up_proj.weight", source, split_dim=0, part=1, num_parts=2)]
    if rest == "shared_mlp.output_linear.weight":
        return [Piece(f"{shared}.down_proj.weight", source)]
    if rest in ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"):
        return [Piece(f"{moe}.experts.gate_proj", source, split_dim=1, part=0, num_parts=2),
                Piece(f"{moe}.experts.up_proj", source, split_dim=1, part=1, num_parts=2)]
    if rest in ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"):
        return [Piece(f"{moe}.experts.down_proj", source)]
    if rest in ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"):
        return [Piece(f"{moe}.gate.weight", source)]
    return []


def pieces_of(source: str, config: HybridModelConfig) -> list[Piece]:
    """Where checkpoint tensor `source` goes; [] when it has no place (the loader reports it)."""
    if config.model_type == "nemotron_h":
        return _nemotron_h(source, config)
    return _granite_or_bamba(source, config)
