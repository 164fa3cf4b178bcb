"""RMSNorm and the Mamba2 gated, grouped RMSNorm, computed in float32 as the reference does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / rms(x); the weight multiply stays in float32, then casts back (NemotronH)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2 output norm: y = weight * groupnorm_rms(x * silu(z)), normalised over `ngroups` groups of
    d_inner / ngroups channels each (norm_before_gate=False). Under TP each rank holds whole groups,
    except with a single group split over the ranks (`spans_ranks`): the sum of squares is then
    all-reduced over `group` and divided by the full width."""

    def __init__(self, d_inner: int, ngroups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_inner))
        self.group_size = d_inner // ngroups
        self.eps = eps
        self.spans_ranks = False
        self.group = None  # TPGroup | None

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() * F.silu(z.float())  # [T, d_inner]
        grouped = x32.view(*x32.shape[:-1], -1, self.group_size)  # [T, ngroups, group_size]
        if self.spans_ranks and self.group is not None:
            sum_sq = grouped.pow(2).sum(-1, keepdim=True)  # [T, 1, 1]: this rank's part of the one group
            self.group.all_reduce(sum_sq)
            variance = sum_sq / (self.group_size * self.group.world_size)
        else:
            variance = grouped.pow(2).mean(-1, keepdim=True)
        grouped = grouped * torch.rsqrt(variance + self.eps)
        return self.weight * grouped.view_as(x32).to(dtype)
