"""GQA attention over a paged KV cache. NemotronH and Granite-4.0-H attention has no positional
embedding; Bamba (and Granite with position_embedding_type: rope) rotate the first `rotary_dim` dims of
each query / key head (RoPE, rotate-half layout) before the key is written to the cache.

Per layer the pool is k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim]. Position p of a
sequence lives in block block_table[p // block_size] at offset p % block_size, i.e. flat slot

    slot(p) = block_table[p // block_size] * block_size + p % block_size

    positions  0 1 2 3 | 4 5 6 7 | 8 9 .  .        block_size 4, block_table [7, 2, 5]
    slots     28 ...31 | 8 ... 11| 20 21            new tokens at 8, 9 are written to slots 20, 21

A step first writes every new token's K/V into its slot, then each chunk's queries attend causally over
positions [0, context + new) gathered through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.model.config import HybridModelConfig
from workers.model.forward_batch import ForwardBatch
from workers.model.kernels import KernelSet


@dataclass(frozen=True)
class PagedPlan:
    """Slot indices of one batch for one pool block size; built once per step, shared by all layers."""

    rows: tuple[slice, ...]  # rows of [T, ...] per chunk
    write_slots: torch.Tensor  # int64 [T]: flat slot of each new token
    read_slots: tuple[torch.Tensor, ...]  # per chunk int64 [context + new]: flat slots of positions 0..
    positions: torch.Tensor  # int64 [T]: position of each new token in its sequence (RoPE)

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device | str) -> PagedPlan:
        reads = []
        for chunk in batch.chunks:
            pos = torch.arange(chunk.num_total_tokens)  # [S]
            table = chunk.block_table.to("cpu", torch.long)
            reads.append((table[pos // block_size] * block_size + pos % block_size).to(device))  # [S]
        writes = torch.cat([r[c.num_context_tokens :] for r, c in zip(reads, batch.chunks)])  # [T]
        positions = torch.cat([torch.arange(c.num_context_tokens, c.num_total_tokens) for c in batch.chunks])
        return cls(tuple(batch.row_slices()), writes, tuple(reads), positions.to(device))


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
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

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
        k_flat[plan.write_slots] = k.to(k_flat.dtype)
        v_flat[plan.write_slots] = v.to(v_flat.dtype)
        out = torch.empty_like(q)  # [T, H, hd]
        for rows, read in zip(plan.rows, plan.read_slots):
            keys = k_flat[read].to(q.dtype)  # [S, Hkv, hd]
            values = v_flat[read].to(q.dtype)  # [S, Hkv, hd]
            out[rows] = self.kernels.attention(q[rows], keys, values, self.scale)
        return self.o_proj(out.view(T, self.num_heads * self.head_dim))
