"""Per-step Mamba metadata: which rows of the batch take which path, built once per forward and shared by
every Mamba layer (index tensors already on the model's device).

    decode   1-token chunks without per-token slots: one batched recurrence step (state update kernels)
    verify   chunks with per_token_state_slots, grouped by length: the state after every token kept
    prefill  every other chunk: one varlen conv + one varlen SSD scan over all of them (cu_seqlens /
             seq_idx), each sequence from its own state slot (zeros when num_context_tokens == 0)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from workers.model.forward_batch import ForwardBatch, VerifyGroup
from workers.model.rows import Index, as_index
from workers.model.varlen import VarlenSeqs


def _on(index: Index, device: torch.device) -> Index:
    return index if isinstance(index, slice) else index.to(device)


@dataclass(frozen=True)
class DecodePlan:
    rows: Index  # [B] rows of the batch
    slots: torch.Tensor  # int64 [B] state slots
    fresh_slots: torch.Tensor | None  # int64: slots of context-0 chunks (zeroed before the step)


@dataclass(frozen=True)
class PrefillPlan:
    rows: Index  # [T_p] rows of the batch, chunk after chunk
    slots: torch.Tensor  # int64 [n] state slots
    has_state: torch.Tensor  # bool [n]: num_context_tokens > 0 (else the initial state is zeros)
    with_state: tuple[int, ...]  # the indices i with has_state[i]
    seqs: VarlenSeqs


@dataclass(frozen=True)
class MambaPlan:
    decode: DecodePlan | None
    verify: tuple[VerifyGroup, ...]
    prefill: PrefillPlan | None

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str) -> MambaPlan:
        device = torch.device(device)
        rows = batch.row_slices()
        decodes, prefills = [], []
        for i, c in enumerate(batch.chunks):
            if c.per_token_state_slots is not None:
                continue
            (decodes if c.num_new_tokens == 1 else prefills).append(i)
        decode = None
        if decodes:
            fresh = [batch.chunks[i].state_slot for i in decodes if batch.chunks[i].num_context_tokens == 0]
            decode = DecodePlan(
                _on(as_index([rows[i].start for i in decodes]), device),
                torch.tensor([batch.chunks[i].state_slot for i in decodes], device=device),
                torch.tensor(fresh, device=device) if fresh else None,
            )
        prefill = None
        if prefills:
            chunks = [batch.chunks[i] for i in prefills]
            has_state = [c.num_context_tokens > 0 for c in chunks]
            prefill = PrefillPlan(
                _on(as_index([t for i in prefills for t in range(rows[i].start, rows[i].stop)]), device),
                torch.tensor([c.state_slot for c in chunks], device=device),
                torch.tensor(has_state, device=device),
                tuple(i for i, s in enumerate(has_state) if s),
                VarlenSeqs(tuple(c.num_new_tokens for c in chunks), device),
            )
        verify = tuple(
            replace(g, rows=_on(g.rows, device), state_slots=_on(g.state_slots, device),
                    token_slots=_on(g.token_slots, device))
            for g in batch.verify_groups
        )
        return cls(decode, verify, prefill)
