"""GQA attention over a paged KV cache. NemotronH and Granite-4.0-H attention has no positional
embedding; Bamba (and Granite with position_embedding_type: rope) rotate the first `rotary_dim` dims of
each query / key head (RoPE, rotate-half layout) before the key is written to the cache.

Per layer the pool is k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim]. Position p of a
sequence lives in block block_table[p // block_size] at offset p % block_size, i.e. flat slot

    slot(p) = block_table[p // block_size] * block_size + p % block_size

    positions  0 1 2 3 | 4 5 6 7 | 8 9 .  .        block_size 4, block_table [7, 2, 5]
    slots     28 ...31 | 8 ... 11| 20 21            new tokens at 8, 9 are written to slots 20, 21

A step first writes every new token's K/V into its slot, then every chunk's queries attend causally over
its positions [0, context + new) in one varlen kernel call for the whole batch (paged_plan.PagedPlan holds
the step's slots and cu_seqlens, built once and shared by every layer).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import HybridModelConfig
from workers.model.kernels import KernelSet
from workers.model.linear import Linear
from workers.model.paged_plan import PagedPlan
from workers.model.rows import copy_rows_


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate the first rotary_dim dims by position (cos/sin in x's dtype, as
    transformers computes them); the rest pass through."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq  # [T, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class PagedAttention(nn.Module):
    """q/k/v/o projections without bias (as transformers' NemotronH / Granite / Bamba attention) + paged
    causal attention. Shard-friendly: a TP rank holds num_heads/tp query heads and num_kv_heads/tp KV heads."""

    def __init__(self, config: HybridModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.rope_theta, self.rotary_dim = config.rope_theta, config.rotary_dim
        self.kernels = kernels
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: PagedPlan
    ) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]. Writes the new tokens' K/V into `kv` in place."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, H, hd]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        if self.rope_theta is not None:
            q = apply_rope(q, plan.positions, self.rotary_dim, self.rope_theta)
            k = apply_rope(k, plan.positions, self.rotary_dim, self.rope_theta)
        k_cache, v_cache = kv
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)  # [blocks * block_size, Hkv, hd]
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)  # [blocks * block_size, Hkv, hd]
        copy_rows_(k_flat, plan.write_slots, k)
        copy_rows_(v_flat, plan.write_slots, v)
        out = self.kernels.attention(q, k_flat, v_flat, plan, self.scale)  # [T, H, hd]
        return self.o_proj(out.view(T, self.num_heads * self.head_dim))
