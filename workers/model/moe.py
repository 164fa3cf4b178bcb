"""Mixture of experts ('E' blocks): a router, routed experts computed grouped per expert, a shared expert.

    weights, ids = gate(x)                       [T, k] float32, [T, k] expert ids
    h = fc1_latent_proj(x)                       latent MoE (Nemotron 3 Super): experts work in moe_latent_size
    routed = sum_j weights[:, j] * expert_{ids[:, j]}(h)      tokens grouped per expert: one matmul pair
                                                              per expert that has tokens, not a loop per token
    out = fc2_latent_proj(routed) + shared_experts(x)

Routers:
    sigmoid_group (NemotronH): s = sigmoid(W x); experts chosen by s + e_score_correction_bias among the
        topk_group groups (of n_group) whose top-2 sum is largest; weights = s of the chosen, divided by
        their sum when norm_topk_prob, times routed_scaling_factor
    softmax_topk (Granite): top-k of W x, weights = softmax over those k logits

Experts (as transformers stores them in memory): up_proj [E, I, in], down_proj [E, in, I], and for gated
experts (Granite) gate_proj [E, I, in] (its fused input_linear split at load time).
Tensor parallel: experts and the shared expert are split along I; the routed sum is all-reduced here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import HybridModelConfig
from workers.model.linear import Linear, linear
from workers.model.mlp import ACTIVATIONS, make_mlp


class TopKRouter(nn.Module):
    def __init__(self, config: HybridModelConfig) -> None:
        super().__init__()
        self.kind = config.moe_router
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if self.kind == "sigmoid_group":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        if self.kind == "softmax_topk":
            logits = F.linear(x, self.weight).float()  # [T, E]
            top, ids = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype).float(), ids
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()  # [T, E]
        T, E = choice.shape
        grouped = choice.view(T, self.n_group, E // self.n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        mask = keep.bool()[:, :, None].expand_as(grouped).reshape(T, E)
        ids = choice.masked_fill(~mask, float("-inf")).topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class Experts(nn.Module):
    def __init__(self, config: HybridModelConfig) -> None:
        super().__init__()
        E, inter, width = config.n_routed_experts, config.moe_intermediate_size, config.moe_input_size
        self.up_proj = nn.Parameter(torch.zeros(E, inter, width))
        self.down_proj = nn.Parameter(torch.zeros(E, width, inter))
        self.gate_proj = nn.Parameter(torch.zeros(E, inter, width)) if config.mlp_gated else None
        self.act = ACTIVATIONS[config.mlp_hidden_act]

    def forward(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [T, width], weights [T, k], ids [T, k] -> [T, width] (float32 accumulation, h's dtype out)."""
        T, k = ids.shape
        flat = ids.reshape(-1)  # [T*k]
        order = flat.argsort(stable=True)  # pairs grouped by expert
        rows = order // k  # [T*k] token of each grouped pair
        counts = torch.bincount(flat, minlength=self.up_proj.shape[0]).tolist()
        xs = h[rows]  # [T*k, width]
        ys = torch.empty(T * k, h.shape[1], dtype=torch.float32, device=h.device)  # [T*k, width]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start : start + n]  # [n, width]
            up = linear(seg, self.up_proj[e])  # [n, I]
            act = self.act(linear(seg, self.gate_proj[e])) * up if self.gate_proj is not None else self.act(up)
            ys[start : start + n] = linear(act, self.down_proj[e]).float()
            start += n
        ys *= weights.reshape(-1)[order, None].float()
        out = torch.zeros(T, h.shape[1], dtype=torch.float32, device=h.device)
        return out.index_add_(0, rows, ys).to(h.dtype)  # [T, width]


class MoE(nn.Module):
    """Parameter names as transformers' NemotronHMoE: gate.*, experts.*, shared_experts.*, fc1/fc2_latent_proj."""

    def __init__(self, config: HybridModelConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_experts = make_mlp(config, config.moe_shared_expert_intermediate_size)
        latent = config.moe_latent_size
        self.fc1_latent_proj = Linear(config.hidden_size, latent, bias=False) if latent else None
        self.fc2_latent_proj = Linear(latent, config.hidden_size, bias=False) if latent else None
        self.group = None  # TPGroup | None: set by tp_shard.attach_group on a shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x  # [T, width]
        routed = self.experts(h, weights, ids)  # [T, width] (a partial sum under TP)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)  # linear, no bias: commutes with the all-reduce
        if self.group is not None:
            self.group.all_reduce(routed)
        return routed + self.shared_experts(x)  # [T, hidden]
