"""Tensor-parallel weight sharding: one rank's slice of a `HybridForCausalLM`.

Each rank holds a model built from `local_config` (heads, groups and MLP width divided by tp_size),
so the unchanged layer code runs on the shard and the caches it allocates are the rank's shard too.

    attention  q/k/v_proj  column-parallel: rows of query heads / KV heads       [H/tp], [Hkv/tp]
               o_proj      row-parallel: matching columns, all-reduce after
    mamba2     in_proj     rows of z | x | B | C | dt for the rank's heads and groups
               conv1d      channels of x | B | C (the rank's heads, then groups); conv state likewise
               dt_bias, A_log, D, norm.weight   the rank's heads / channels
               out_proj    row-parallel
    mlp        up_proj (+ gate_proj)  column-parallel: intermediate/tp rows;  down_proj row-parallel
    moe        experts up/gate_proj [E, I, in] and down_proj [E, in, I] split along I (every rank holds
               every expert's slice, so routing needs no token exchange); the routed sum is all-reduced
               in MoE.forward; the shared expert is an MLP as above; router and latent projections replicated
    replicated embeddings, every RMSNorm, MTP eh_proj; lm_head on rank 0 only (logits stay there)

Mamba head h belongs to group h // (nheads / ngroups), so with ngroups % tp == 0 the rank's heads use
exactly its groups' B and C, and the gated RMSNorm (one norm per group) never spans two ranks. With
ngroups == 1 (Granite-4.0-H, Bamba) every rank holds the one group's B and C (replicated) and the gated
norm over all of d_inner spans the ranks: its sum of squares is all-reduced (as vLLM does).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from workers.model.attention import PagedAttention
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.errors import TensorParallelError
from workers.model.hybrid import HybridForCausalLM
from workers.model.kernels import KernelSet
from workers.model.linear import linear
from workers.model.mamba2 import Mamba2Mixer
from workers.model.mlp import MLP, GatedMLP
from workers.model.moe import MoE
from workers.model.norms import GatedRMSNorm


def _split_fields(config: HybridModelConfig) -> dict[str, str]:
    """Config fields divided by tp_size -> why, for the layer kinds this model has."""
    kinds = set(config.layer_kinds) | set(config.mtp_layer_kinds)
    fields = {}
    if LayerKind.ATTENTION in kinds:
        fields["num_attention_heads"] = "attention query heads"
        fields["num_key_value_heads"] = "attention KV heads (KV replication is not implemented)"
    if LayerKind.MAMBA in kinds:
        fields["mamba_num_heads"] = "Mamba heads"
        if config.n_groups > 1:  # one group is replicated on every rank instead
            fields["n_groups"] = "Mamba groups (B/C and the gated RMSNorm groups stay whole on one rank)"
    if LayerKind.MLP in kinds:
        fields["intermediate_size"] = "MLP intermediate channels"
    if LayerKind.MOE in kinds:
        fields["moe_intermediate_size"] = "MoE expert intermediate channels"
        fields["moe_shared_expert_intermediate_size"] = "MoE shared expert intermediate channels"
    return fields


def validate_tp_size(config: HybridModelConfig, tp_size: int) -> None:
    """Raise TensorParallelError naming every field tp_size does not divide."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"tp_size must be a positive integer, got {tp_size!r}")
    bad = [f"{name}={getattr(config, name)} ({why})" for name, why in _split_fields(config).items()
           if getattr(config, name) % tp_size]
    if bad:
        raise TensorParallelError(f"tp_size={tp_size} must divide " + "; ".join(bad))


def local_config(config: HybridModelConfig, tp_size: int) -> HybridModelConfig:
    """The config one rank's shard is built from."""
    validate_tp_size(config, tp_size)
    return dataclasses.replace(
        config, **{name: getattr(config, name) // tp_size for name in _split_fields(config)}
    )


def _block(n: int, tp_size: int, rank: int) -> torch.Tensor:
    size = n // tp_size
    return torch.arange(rank * size, (rank + 1) * size)


def _expand(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Unit ids (heads, groups) -> channel ids of `width` channels each."""
    return (ids[:, None] * width + torch.arange(width)).reshape(-1)


def param_slices(model: HybridForCausalLM, tp_size: int, rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Full parameter name -> (dim, indices) kept by `rank`; names not listed are replicated. `model` is
    the full model (on the meta device is enough)."""
    c = model.config
    heads_q = _expand(_block(c.num_attention_heads, tp_size, rank), c.head_dim)
    heads_kv = _expand(_block(c.num_key_value_heads, tp_size, rank), c.head_dim)
    heads = _block(c.mamba_num_heads, tp_size, rank)
    inner = _expand(heads, c.mamba_head_dim)  # x / z / norm channels
    groups = _block(c.n_groups, tp_size, rank) if c.n_groups > 1 else torch.arange(1)  # 1 group: replicated
    gn = _expand(groups, c.ssm_state_size)  # B or C channels
    xbc = torch.cat([inner, c.d_inner + gn, c.d_inner + c.n_groups * c.ssm_state_size + gn])
    in_rows = torch.cat([inner, c.d_inner + xbc, c.d_inner + c.conv_dim + heads])

    def mlp_rules(module: nn.Module) -> dict:
        cols = _block(module.down_proj.in_features, tp_size, rank)
        rules = {"up_proj.weight": (0, cols), "up_proj.bias": (0, cols), "down_proj.weight": (1, cols)}
        if isinstance(module, GatedMLP):
            rules.update({"gate_proj.weight": (0, cols), "gate_proj.bias": (0, cols)})
        return rules

    expert_cols = _block(c.moe_intermediate_size, tp_size, rank) if c.moe_layer_ids or c.n_routed_experts else None
    rules = {
        PagedAttention: lambda m: {"q_proj.weight": (0, heads_q), "k_proj.weight": (0, heads_kv),
                                   "v_proj.weight": (0, heads_kv), "o_proj.weight": (1, heads_q)},
        MLP: mlp_rules,
        GatedMLP: mlp_rules,
        MoE: lambda m: {"experts.up_proj": (1, expert_cols), "experts.gate_proj": (1, expert_cols),
                        "experts.down_proj": (2, expert_cols)},
        Mamba2Mixer: lambda m: {"in_proj.weight": (0, in_rows), "in_proj.bias": (0, in_rows),
                                "conv1d.weight": (0, xbc), "conv1d.bias": (0, xbc), "dt_bias": (0, heads),
                                "A_log": (0, heads), "D": (0, heads), "norm.weight": (0, inner),
                                "out_proj.weight": (1, inner)},
    }
    out = {}
    for prefix, module in model.named_modules():
        rule = rules.get(type(module))
        if rule is not None:
            for param, r in rule(module).items():
                out[f"{prefix}.{param}"] = r
    return out


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input's last dim is split over ranks, the output is
    full on every rank. Same parameter names as the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear, group) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.group = group  # TPGroup | None (None: a 1-rank shard, no reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # [T, out] partial sum of this rank
        if self.group is not None:
            self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


_ROW_PARALLEL = {PagedAttention: "o_proj", Mamba2Mixer: "out_proj", MLP: "down_proj", GatedMLP: "down_proj"}


def attach_group(shard: HybridForCausalLM, group) -> None:
    """Point every row-parallel layer of the shard at `group` (the ranks can load before they join)."""
    for module in shard.modules():
        if isinstance(module, (RowParallelLinear, MoE)) or (isinstance(module, GatedRMSNorm) and module.spans_ranks):
            module.group = group


def shard_model(full: HybridForCausalLM, tp_size: int, rank: int, *, kernels: KernelSet,
                device: torch.device | str = "cpu", group=None) -> HybridForCausalLM:
    """Rank `rank`'s shard of a loaded model (eval, no grad, on `device`). Loading a checkpoint straight
    into a shard (loader.load_model(tp_size=..., tp_rank=...)) avoids holding the full model."""
    slices = param_slices(full, tp_size, rank)
    state = {name: (t.index_select(slices[name][0], slices[name][1]) if name in slices else t)
             .to(device).contiguous() for name, t in full.state_dict().items()}
    if full.tied:
        state.pop("lm_head.weight")
    if rank > 0:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        shard = HybridForCausalLM(local_config(full.config, tp_size), kernels, with_mtp=full.mtp is not None,
                                  tie_lm_head=full.tied)
    spans = tp_size > 1 and full.config.n_groups == 1
    return finish_shard(shard, state, rank, full.dtype, device, group, norm_spans_ranks=spans)


def finish_shard(shard: HybridForCausalLM, state: dict[str, torch.Tensor], rank: int, dtype: torch.dtype,
                 device: torch.device | str, group=None, *, norm_spans_ranks: bool) -> HybridForCausalLM:
    """Assign a shard's (already sliced) weights; rank > 0 gets an empty lm_head (logits on rank 0);
    row-parallel layers are wrapped to all-reduce over `group` (attach_group can set it later).
    norm_spans_ranks: the full model has one Mamba group and tp_size > 1 (the gated norm then reduces
    across the ranks)."""
    hidden = shard.config.hidden_size
    if rank > 0:
        state["lm_head.weight"] = torch.empty(0, hidden, dtype=dtype, device=device)
        shard.lm_head.weight = nn.Parameter(torch.empty(0, hidden, dtype=dtype, device="meta"))
    elif shard.tied:
        state.pop("lm_head.weight", None)
    shard.load_state_dict(state, strict=not shard.tied or rank > 0, assign=True)
    if shard.tied and rank == 0:
        shard.lm_head.weight = shard.model.embeddings.weight
    for module in list(shard.modules()):
        name = _ROW_PARALLEL.get(type(module))
        if name is not None:
            setattr(module, name, RowParallelLinear(getattr(module, name), group))
        if isinstance(module, MoE):
            module.group = group
        if isinstance(module, GatedRMSNorm) and norm_spans_ranks:
            module.spans_ranks, module.group = True, group
    shard.requires_grad_(False)
    return shard.eval()
