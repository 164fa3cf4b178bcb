"""Cache tensors of one model replica: paged attention KV, Mamba state slots, the MTP head's draft KV.

    kv[layer]        (k, v)  [num_kv_blocks, kv_block_size, n_kv_heads, head_dim]     model dtype
    conv[layer]              [num_state_slots, conv_dim, d_conv - 1]                  model dtype
    ssm[layer]               [num_state_slots, nheads, head_dim, d_state]             mamba_ssm_cache_dtype
    draft_kv[mtp_layer] (k, v) [num_draft_blocks, draft_block_size, n_kv_heads, head_dim]

Block ids and slot ids are owned by the engine's cache manager; this module only allocates, copies and
sizes pages. Shapes are per tensor-parallel rank (heads / channels split, see tp_shard.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.model.config import HybridModelConfig
from workers.model.rows import copy_rows_


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ssm_state_dtype(config: HybridModelConfig) -> torch.dtype:
    return getattr(torch, config.mamba_ssm_cache_dtype)


def kv_bytes_per_block(config: HybridModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K + V bytes of one block over all target attention layers."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * _elem_bytes(dtype)
    return per_layer * len(config.attention_layer_ids)


def draft_kv_bytes_per_block(config: HybridModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K + V bytes of one block over the MTP head's attention layers (0 without MTP)."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * _elem_bytes(dtype)
    return per_layer * len(config.mtp_attention_layer_ids)


def state_bytes_per_slot(config: HybridModelConfig, dtype: torch.dtype) -> int:
    """Conv + SSM state bytes of one slot over all Mamba layers."""
    conv = config.conv_dim * (config.conv_kernel - 1) * _elem_bytes(dtype)
    ssm = (
        config.mamba_num_heads
        * config.mamba_head_dim
        * config.ssm_state_size
        * _elem_bytes(ssm_state_dtype(config))
    )
    return (conv + ssm) * len(config.mamba_layer_ids)


@dataclass
class ModelCaches:
    """All cache tensors. Mutated in place by forward (KV slots written, state slots overwritten)."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    draft_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def kv_block_size(self) -> int | None:
        return next(iter(self.kv.values()))[0].shape[1] if self.kv else None

    @property
    def num_kv_blocks(self) -> int | None:
        return next(iter(self.kv.values()))[0].shape[0] if self.kv else None

    @property
    def draft_block_size(self) -> int | None:
        return next(iter(self.draft_kv.values()))[0].shape[1] if self.draft_kv else None

    @property
    def num_draft_blocks(self) -> int | None:
        return next(iter(self.draft_kv.values()))[0].shape[0] if self.draft_kv else None

    @property
    def num_state_slots(self) -> int | None:
        return next(iter(self.ssm.values())).shape[0] if self.ssm else None

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy the conv and SSM state of every Mamba layer from one slot to another."""
        for layer, conv in self.conv.items():
            conv[dst_slot].copy_(conv[src_slot])
            self.ssm[layer][dst_slot].copy_(self.ssm[layer][src_slot])

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """copy_state for many pairs at once: one gather and one scatter per pool and layer (a step's
        speculative rollbacks). Sources are read before any destination is written; no slot may be a
        destination twice."""
        if len(src_slots) != len(dst_slots) or len(set(dst_slots)) != len(dst_slots):
            raise ValueError(f"copy_states needs distinct destinations, one per source: {src_slots} -> {dst_slots}")
        if not src_slots or not self.conv:
            return
        device = next(iter(self.conv.values())).device
        src = torch.tensor(src_slots, device=device)
        dst = torch.tensor(dst_slots, device=device)
        for layer, conv in self.conv.items():
            copy_rows_(conv, dst, conv.index_select(0, src))
            ssm = self.ssm[layer]
            copy_rows_(ssm, dst, ssm.index_select(0, src))

    def zero_state(self, slot: int) -> None:
        for layer, conv in self.conv.items():
            conv[slot].zero_()
            self.ssm[layer][slot].zero_()

    def kv_bytes_per_block(self) -> int:
        return sum(
            k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in self.kv.values()
        )

    def draft_kv_bytes_per_block(self) -> int:
        return sum(
            k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
            for k, v in self.draft_kv.values()
        )

    def state_bytes_per_slot(self) -> int:
        return sum(
            self.conv[i][0].numel() * self.conv[i].element_size()
            + self.ssm[i][0].numel() * self.ssm[i].element_size()
            for i in self.conv
        )


def allocate_caches(
    config: HybridModelConfig,
    num_kv_blocks: int,
    kv_block_size: int,
    num_state_slots: int,
    num_draft_blocks: int = 0,
    draft_block_size: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelCaches:
    """Zero-filled caches for `config`. Draft KV is allocated only when num_draft_blocks > 0 and the
    config has an MTP head; draft_block_size defaults to kv_block_size."""
    if kv_block_size < 1 or num_kv_blocks < 0 or num_state_slots < 0 or num_draft_blocks < 0:
        raise ValueError("cache sizes must be non-negative (block sizes positive)")
    kv_shape = (num_kv_blocks, kv_block_size, config.num_key_value_heads, config.head_dim)
    kv = {
        i: (
            torch.zeros(kv_shape, dtype=dtype, device=device),
            torch.zeros(kv_shape, dtype=dtype, device=device),
        )
        for i in config.attention_layer_ids
    }
    conv_shape = (num_state_slots, config.conv_dim, config.conv_kernel - 1)
    ssm_shape = (num_state_slots, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size)
    conv = {i: torch.zeros(conv_shape, dtype=dtype, device=device) for i in config.mamba_layer_ids}
    ssm = {
        i: torch.zeros(ssm_shape, dtype=ssm_state_dtype(config), device=device)
        for i in config.mamba_layer_ids
    }
    draft_kv = {}
    if num_draft_blocks:
        d_shape = (
            num_draft_blocks,
            draft_block_size or kv_block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        draft_kv = {
            i: (
                torch.zeros(d_shape, dtype=dtype, device=device),
                torch.zeros(d_shape, dtype=dtype, device=device),
            )
            for i in config.mtp_attention_layer_ids
        }
    return ModelCaches(kv=kv, conv=conv, ssm=ssm, draft_kv=draft_kv)
