"""What one model step computes: the batch's chunks (the engine's side of the forward contract).

A batch concatenates the new tokens of several sequences (continuous batching: prefill chunks of some
mixed with 1-token decodes or k+1-token verifies of others). Rows of `input_ids` / hidden are in chunk
order:

    input_ids  [ a0 a1 a2 a3 | b0 | c0 c1 ]     chunk a: prefill, context 0
    positions  [ 0  1  2  3  | 57 | 9  10 ]     chunk b: decode, context 57;  chunk c: verify, context 9
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from workers.model.errors import ForwardBatchError
from workers.model.rows import Index, as_index


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's slice of a batch.

    num_context_tokens: tokens of this sequence already in the caches; new tokens get positions
        context .. context+new-1.
    num_new_tokens: tokens of this sequence in the batch (>= 1).
    block_table: int64 [n] block ids in the attention KV pool covering positions [0, context+new).
    state_slot: Mamba state slot. Read as the initial (conv, ssm) state when num_context_tokens > 0,
        zeros when 0; overwritten in place with the state after the chunk.
    per_token_state_slots: if given (len == num_new_tokens), after new token j the state of every Mamba
        layer is also written to slot per_token_state_slots[j] (speculative-decode rollback).
    """

    num_context_tokens: int
    num_new_tokens: int
    block_table: torch.Tensor
    state_slot: int
    per_token_state_slots: tuple[int, ...] | None = None

    @property
    def num_total_tokens(self) -> int:
        return self.num_context_tokens + self.num_new_tokens


@dataclass(frozen=True)
class VerifyGroup:
    """The verify chunks (per_token_state_slots set) of one length L in a batch, for one Mamba pass.

    rows [b*L] of the batch and token_slots [b*L] (per-token state slots) in chunk-major token order;
    state_slots [b]; fresh_slots: the state slots of chunks with context 0 (read as zeros)."""

    num_chunks: int
    num_new_tokens: int
    rows: Index
    state_slots: Index
    token_slots: Index
    fresh_slots: tuple[int, ...]


@dataclass(frozen=True)
class ForwardCounts:
    """What a model (one TP rank's shard) has run through its forward since it was built: every row,
    and the rows its batches declared prompt tokens (the prefill work a prefix hit saves)."""

    num_tokens: int = 0
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    """input_ids: int64 [T], the chunks' new tokens concatenated in chunk order.
    num_prompt_tokens: how many of the T rows are prompt tokens (prefill chunks), for the work counts.
    block_id_range: (smallest, largest) id over every chunk's whole block_table, when the builder knows
        it from the lists the tables came from (the engine does); validation then checks the pool range
        on these two ints instead of reading the tables (a device sync where tables live on a GPU)."""

    input_ids: torch.Tensor
    chunks: tuple[SeqChunk, ...]
    num_prompt_tokens: int = 0
    block_id_range: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def row_slices(self) -> list[slice]:
        """Rows of input_ids (and of every [T, ...] activation) belonging to each chunk."""
        out, start = [], 0
        for chunk in self.chunks:
            out.append(slice(start, start + chunk.num_new_tokens))
            start += chunk.num_new_tokens
        return out

    @cached_property
    def verify_groups(self) -> tuple[VerifyGroup, ...]:
        """Verify chunks grouped by length (computed once per batch, shared by all Mamba layers).
        Index tensors are on the CPU: callers move them to their device."""
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(self.chunks):
            if c.per_token_state_slots is not None:
                by_len.setdefault(c.num_new_tokens, []).append(i)
        rows, groups = self.row_slices(), []
        for n, members in by_len.items():
            chunks = [self.chunks[i] for i in members]
            groups.append(VerifyGroup(
                len(chunks), n,
                as_index([t for i in members for t in range(rows[i].start, rows[i].stop)]),
                as_index([c.state_slot for c in chunks]),
                as_index([s for c in chunks for s in c.per_token_state_slots]),
                tuple(c.state_slot for c in chunks if c.num_context_tokens == 0),
            ))
        return tuple(groups)

    def positions(self) -> torch.Tensor:
        """int64 [T]: the position of every new token in its sequence."""
        parts = [torch.arange(c.num_context_tokens, c.num_total_tokens) for c in self.chunks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def validate(self, block_size: int | None, num_blocks: int | None, num_state_slots: int | None) -> None:
        """Raise ForwardBatchError if the batch is inconsistent. `None` skips the pool checks of that kind
        (no attention layers / no Mamba layers / the MTP head, which ignores state slots)."""
        if self.input_ids.dim() != 1:
            raise ForwardBatchError(f"input_ids must be 1-D [T], got shape {tuple(self.input_ids.shape)}")
        if not self.chunks:
            raise ForwardBatchError("a ForwardBatch needs at least one chunk")
        total = sum(c.num_new_tokens for c in self.chunks)
        if total != self.num_tokens:
            raise ForwardBatchError(f"chunks hold {total} new tokens but input_ids has {self.num_tokens}")
        if not 0 <= self.num_prompt_tokens <= total:
            raise ForwardBatchError(f"num_prompt_tokens={self.num_prompt_tokens} outside [0, {total}]")
        if not self._chunks_look_valid(block_size, num_blocks, num_state_slots):
            self._raise_for_invalid_chunk(block_size, num_blocks, num_state_slots)
            raise ForwardBatchError("inconsistent chunks")  # the two checks disagree: never pass silently

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """int64 [n, max table length]: every chunk's block_table, zero-padded (computed once per batch, for
        validation and the attention plan). Only a chunk's first ceil(total / block_size) entries are read."""
        return torch.nn.utils.rnn.pad_sequence([c.block_table for c in self.chunks], batch_first=True)

    def _chunks_look_valid(self, block_size: int | None, num_blocks: int | None, num_state_slots: int | None) -> bool:
        """The per-chunk checks of _raise_for_invalid_chunk over the whole batch at once (a step of 32
        decodes must not pay a Python loop of tensor slices for them): True iff that would not raise."""
        chunks = self.chunks
        if min(c.num_new_tokens for c in chunks) < 1 or min(c.num_context_tokens for c in chunks) < 0:
            return False
        if block_size is not None:
            if any(c.block_table.dim() != 1 for c in chunks):
                return False
            need = [-(-c.num_total_tokens // block_size) for c in chunks]
            lengths = [c.block_table.shape[0] for c in chunks]
            if any(length < k for length, k in zip(lengths, need)):
                return False
            if num_blocks is not None and self.block_id_range is not None:
                lo, hi = self.block_id_range  # every entry in range: the used ones are too
                if lo < 0 or hi >= num_blocks:
                    return False
            elif num_blocks is not None:
                tables = self.block_tables  # zero padding is a valid id: it cannot fail the range check
                if lengths != need:  # tables longer than needed: only their used entries must be in range
                    used = torch.arange(tables.shape[1])[None] < torch.tensor(need)[:, None]  # [n, max length]
                    tables = tables.masked_select(used)
                lo, hi = torch.aminmax(tables)
                if int(lo) < 0 or int(hi) >= num_blocks:
                    return False
        if num_state_slots is not None:
            slots = [c.state_slot for c in chunks]
            if len(set(slots)) != len(slots) or min(slots) < 0 or max(slots) >= num_state_slots:
                return False
            for c in chunks:
                per_token = c.per_token_state_slots
                if per_token is not None and (len(per_token) != c.num_new_tokens or min(per_token) < 0
                                              or max(per_token) >= num_state_slots):
                    return False
        return True

    def _raise_for_invalid_chunk(self, block_size: int | None, num_blocks: int | None,
                                 num_state_slots: int | None) -> None:
        """Chunk by chunk: raise ForwardBatchError naming the first inconsistent chunk."""
        seen_slots: set[int] = set()
        used_tables: list[torch.Tensor] = []
        for i, c in enumerate(self.chunks):
            if c.num_new_tokens < 1 or c.num_context_tokens < 0:
                raise ForwardBatchError(
                    f"chunk {i}: need num_new_tokens >= 1 and num_context_tokens >= 0, "
                    f"got {c.num_new_tokens}, {c.num_context_tokens}"
                )
            if block_size is not None:
                need = -(-c.num_total_tokens // block_size)
                if c.block_table.dim() != 1 or c.block_table.shape[0] < need:
                    raise ForwardBatchError(
                        f"chunk {i}: block_table covers {c.block_table.numel()} blocks, "
                        f"positions [0, {c.num_total_tokens}) need {need} of {block_size}"
                    )
                used_tables.append(c.block_table[:need])
            if num_state_slots is not None:
                slots = [c.state_slot, *(c.per_token_state_slots or ())]
                if c.per_token_state_slots is not None and len(c.per_token_state_slots) != c.num_new_tokens:
                    raise ForwardBatchError(
                        f"chunk {i}: {len(c.per_token_state_slots)} per_token_state_slots "
                        f"for {c.num_new_tokens} new tokens"
                    )
                for s in slots:
                    if not 0 <= s < num_state_slots:
                        raise ForwardBatchError(
                            f"chunk {i}: state slot {s} outside pool of {num_state_slots}"
                        )
                if c.state_slot in seen_slots:
                    raise ForwardBatchError(f"chunk {i}: state slot {c.state_slot} used twice in one batch")
                seen_slots.add(c.state_slot)
        if num_blocks is not None and used_tables:
            used = torch.cat(used_tables)  # one range check for the whole batch; find the culprit only on failure
            if used.numel() and (used.min() < 0 or used.max() >= num_blocks):
                i = next(i for i, t in enumerate(used_tables) if t.numel() and (t.min() < 0 or t.max() >= num_blocks))
                raise ForwardBatchError(f"chunk {i}: block ids {used_tables[i].tolist()} outside pool of {num_blocks}")
