"""Tensor-parallel weight sharding: one rank's slice of a `HybridForCausalLM`.

Each rank holds a model built from `local_config` (heads, groups and MLP width divided by tp_size),
so the unchanged layer code runs on the shard and the caches it allocates are the rank's shard too.

    attention  q/k/v_proj  column-parallel: rows of query heads / KV heads       [H/tp], [Hkv/tp]
               o_proj      row-parallel: matching columns, all-reduce after
    mamba2     in_proj     rows of z | x | B | C | dt for the rank's heads and groups
               conv1d      channels of x | B | C (the rank's heads, then groups); conv state likewise
               dt_bias, A_log, D, norm.weight   the rank's heads / channels
               out_proj    row-parallel
    mlp        up_proj     column-parallel: intermediate_size/tp rows;  down_proj row-parallel
    replicated embeddings, every RMSNorm, MTP eh_proj; lm_head on rank 0 only (logits stay there)

Mamba head h belongs to group h // (nheads / ngroups), so with ngroups % tp == 0 the rank's heads use
exactly its groups' B and C, and the gated RMSNorm (one norm per group) never spans two ranks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import PagedAttention
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.errors import TensorParallelError
from workers.model.hybrid import HybridForCausalLM
from workers.model.kernels import KernelSet
from workers.model.mamba2 import Mamba2Mixer
from workers.model.mlp import MLP


def _split_fields(config: HybridModelConfig) -> dict[str, str]:
    """Config fields divided by tp_size -> why, for the layer kinds this model has."""
    kinds = set(config.layer_kinds) | set(config.mtp_layer_kinds)
    fields = {}
    if LayerKind.ATTENTION in kinds:
        fields["num_attention_heads"] = "attention query heads"
        fields["num_key_value_heads"] = "attention KV heads (KV replication is not implemented)"
    if LayerKind.MAMBA in kinds:
        fields["mamba_num_heads"] = "Mamba heads"
        fields["n_groups"] = "Mamba groups (B/C and the gated RMSNorm groups stay whole on one rank)"
    if LayerKind.MLP in kinds:
        fields["intermediate_size"] = "MLP intermediate channels"
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


def _param_slices(model: HybridForCausalLM, tp_size: int, rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Full parameter name -> (dim, indices) kept by `rank`; names not listed are replicated."""
    c = model.config
    heads_q = _expand(_block(c.num_attention_heads, tp_size, rank), c.head_dim)
    heads_kv = _expand(_block(c.num_key_value_heads, tp_size, rank), c.head_dim)
    mlp = _block(c.intermediate_size, tp_size, rank)
    heads = _block(c.mamba_num_heads, tp_size, rank)
    inner = _expand(heads, c.mamba_head_dim)  # x / z / norm channels
    gn = _expand(_block(c.n_groups, tp_size, rank), c.ssm_state_size)  # B or C channels
    xbc = torch.cat([inner, c.d_inner + gn, c.d_inner + c.n_groups * c.ssm_state_size + gn])
    in_rows = torch.cat([inner, c.d_inner + xbc, c.d_inner + c.conv_dim + heads])
    rules = {
        PagedAttention: {"q_proj.weight": (0, heads_q), "k_proj.weight": (0, heads_kv),
                         "v_proj.weight": (0, heads_kv), "o_proj.weight": (1, heads_q)},
        MLP: {"up_proj.weight": (0, mlp), "up_proj.bias": (0, mlp), "down_proj.weight": (1, mlp)},
        Mamba2Mixer: {"in_proj.weight": (0, in_rows), "in_proj.bias": (0, in_rows),
                      "conv1d.weight": (0, xbc), "conv1d.bias": (0, xbc), "dt_bias": (0, heads),
                      "A_log": (0, heads), "D": (0, heads), "norm.weight": (0, inner),
                      "out_proj.weight": (1, inner)},
    }
    out = {}
    for prefix, module in model.named_modules():
        for param, rule in rules.get(type(module), {}).items():
            out[f"{prefix}.{param}"] = rule
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
        y = F.linear(x, self.weight)  # [T, out] partial sum of this rank
        if self.group is not None:
            self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


_ROW_PARALLEL = {PagedAttention: "o_proj", Mamba2Mixer: "out_proj", MLP: "down_proj"}


def attach_group(shard: HybridForCausalLM, group) -> None:
    """Point every row-parallel layer of the shard at `group` (the ranks can load before they join)."""
    for module in shard.modules():
        if isinstance(module, RowParallelLinear):
            module.group = group


def shard_model(full: HybridForCausalLM, tp_size: int, rank: int, *, kernels: KernelSet,
                device: torch.device | str = "cpu", group=None) -> HybridForCausalLM:
    """Rank `rank`'s shard of a loaded model (eval, no grad, on `device`)."""
    config = local_config(full.config, tp_size)
    slices = _param_slices(full, tp_size, rank)
    state = {name: (t.index_select(slices[name][0], slices[name][1]) if name in slices else t)
             .to(device).contiguous() for name, t in full.state_dict().items()}
    with torch.device("meta"):
        shard = HybridForCausalLM(config, kernels, with_mtp=full.mtp is not None)
    shard.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        shard.lm_head.weight = shard.model.embeddings.weight
    if rank > 0:  # logits are computed on rank 0 only
        shard.lm_head.weight = nn.Parameter(torch.empty(0, config.hidden_size, dtype=full.dtype, device=device))
    for module in list(shard.modules()):
        name = _ROW_PARALLEL.get(type(module))
        if name is not None:
            setattr(module, name, RowParallelLinear(getattr(module, name), group))
    shard.requires_grad_(False)
    return shard.eval()
