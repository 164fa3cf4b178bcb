"""Per-step attention metadata over a paged KV pool: built once per forward, shared by every layer.

Position p of chunk i lives in flat slot  table_i[p // block_size] * block_size + p % block_size.

    read_slots  [n, S_max]  slots of positions 0 .. S_i - 1 of every chunk (0 past S_i: masked)
    write_slots [T]         slot of every new token (positions context_i .. S_i - 1)
    cu_seqlens_q / _k       [n + 1] int32: query rows and key positions per chunk (flash-attn varlen)

The torch kernel runs SDPA once per *group* of chunks padded to the group's longest query and context
(`sdpa_groups`): chunks are sorted by size and a group grows while its padded work stays within twice
its real work, so 32 decodes attend in one call and a long prefill chunk does not pad them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from workers.model.forward_batch import ForwardBatch

_SLACK = 4096  # padded query x key elements a group may waste for free (small groups merge)


@dataclass(frozen=True)
class SdpaGroup:
    """Chunks attending in one padded SDPA call: b chunks, n_max query rows, s_max keys."""

    q_rows: torch.Tensor  # int64 [b, n_max]: row of T of each query (padding repeats the chunk's last row)
    key_slots: torch.Tensor  # int64 [b, s_max]: flat KV slot of each key position
    mask: torch.Tensor  # bool [b, 1, n_max, s_max]: causal, bottom-right aligned per chunk
    valid_pos: torch.Tensor | None  # int64: positions of real queries in the flattened [b * n_max] (None: all)
    out_rows: torch.Tensor  # int64: row of T of each real query, in that order


@dataclass(frozen=True)
class PagedPlan:
    num_new: tuple[int, ...]  # per chunk
    num_total: tuple[int, ...]  # per chunk: context + new
    read_slots: torch.Tensor  # int64 [n, S_max] (device)
    write_slots: torch.Tensor  # int64 [T] (device)
    positions: torch.Tensor  # int64 [T] (device): position of each new token in its sequence (RoPE)
    fixed_groups: tuple[SdpaGroup, ...] | None = None  # set by build_padded_decode: the one static group

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device | str) -> PagedPlan:
        """Sizes come from the chunks' Python ints: nothing here reads a tensor's values (no device sync,
        no data-dependent shape), so the plan costs a fixed number of host ops per step."""
        chunks = batch.chunks
        num_new = tuple(c.num_new_tokens for c in chunks)
        num_total = tuple(c.num_total_tokens for c in chunks)
        s_max, num_rows = max(num_total), sum(num_new)
        tables = batch.block_tables.to("cpu", torch.long)  # [n, max blocks]; entries past a chunk's need are masked
        pos = torch.arange(s_max)  # [S_max]
        read = tables[:, pos // block_size] * block_size + pos % block_size  # [n, S_max]
        read = read.masked_fill(pos[None] >= torch.tensor(num_total)[:, None], 0)
        new = torch.tensor(num_new)
        chunk_of_row = torch.repeat_interleave(torch.arange(len(chunks)), new, output_size=num_rows)  # [T]
        row_start = torch.cumsum(new, 0) - new  # [n]
        context = torch.tensor(num_total) - new  # [n]
        positions = context[chunk_of_row] + torch.arange(num_rows) - row_start[chunk_of_row]  # [T]
        writes = read[chunk_of_row, positions]  # [T]
        device = torch.device(device)
        return cls(num_new, num_total, read.to(device), writes.to(device), positions.to(device))

    @classmethod
    def build_padded_decode(cls, batch: ForwardBatch, block_size: int, device: torch.device | str,
                            num_keys: int) -> PagedPlan:
        """A plan of chunks of one common length L (decodes: 1, verifies: 1 + drafts) whose shapes depend
        on (n, L, num_keys) alone: keys padded to `num_keys` (>= every chunk's total) and one SDPA group of
        all chunks, [n, L, num_keys] (a CUDA graph replays fixed shapes; masked keys add exact zeros)."""
        chunks = batch.chunks
        length = chunks[0].num_new_tokens
        num_total = tuple(c.num_total_tokens for c in chunks)
        if any(c.num_new_tokens != length for c in chunks) or max(num_total) > num_keys:
            raise ValueError(f"a padded plan needs chunks of one length and at most {num_keys} positions")
        n = len(chunks)
        tables = batch.block_tables.to("cpu", torch.long)  # [n, max blocks]
        pos = torch.arange(num_keys)  # [num_keys]
        col = (pos // block_size).clamp(max=tables.shape[1] - 1)  # past a table: masked below
        total = torch.tensor(num_total)  # [n]
        read = (tables[:, col] * block_size + pos % block_size).masked_fill(pos[None] >= total[:, None], 0)
        r = torch.arange(length)  # [L]
        q_pos = (total - length)[:, None] + r  # [n, L]
        rows = torch.arange(n * length)  # [n * L]
        writes = read[rows // length, q_pos.flatten()]  # [n * L]
        mask = pos[None, None] <= q_pos[..., None]  # [n, L, num_keys]: causal, bottom-right aligned
        device = torch.device(device)
        read = read.to(device)
        group = SdpaGroup(rows.view(n, length).to(device), read, mask[:, None].to(device), None, rows.to(device))
        return cls((length,) * n, num_total, read, writes.to(device), q_pos.flatten().to(device), (group,))

    @property
    def device(self) -> torch.device:
        return self.read_slots.device

    @cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        return _cumsum(self.num_new, self.device)

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        return _cumsum(self.num_total, self.device)

    @cached_property
    def packed_read_slots(self) -> torch.Tensor:
        """int64 [sum S_i]: every chunk's key slots back to back (flash-attn varlen keys)."""
        total = torch.tensor(self.num_total)  # [n]
        num_keys = sum(self.num_total)
        chunk = torch.repeat_interleave(torch.arange(len(self.num_total)), total, output_size=num_keys)  # [sum S_i]
        key_pos = torch.arange(num_keys) - (torch.cumsum(total, 0) - total)[chunk]  # [sum S_i]
        return self.read_slots[chunk.to(self.device), key_pos.to(self.device)]

    @cached_property
    def sdpa_groups(self) -> tuple[SdpaGroup, ...]:
        if self.fixed_groups is not None:
            return self.fixed_groups
        order = sorted(range(len(self.num_new)), key=lambda i: (self.num_new[i], self.num_total[i]))
        groups: list[list[int]] = []
        real = n_max = s_max = 0
        for i in order:
            n, s = self.num_new[i], self.num_total[i]
            if groups:
                grown = (len(groups[-1]) + 1) * max(n_max, n) * max(s_max, s)
                if grown <= 2 * (real + n * s) + _SLACK:
                    groups[-1].append(i)
                    real, n_max, s_max = real + n * s, max(n_max, n), max(s_max, s)
                    continue
            groups.append([i])
            real, n_max, s_max = n * s, n, s
        return tuple(self._group(members) for members in groups)

    def _group(self, members: list[int]) -> SdpaGroup:
        new_of = [self.num_new[i] for i in members]
        n_max, s_max = max(new_of), max(self.num_total[i] for i in members)
        starts = list(itertools.accumulate(self.num_new, initial=0))  # row of T where each chunk starts
        idx = torch.tensor(members)
        new = torch.tensor(new_of)  # [b]
        total = torch.tensor([self.num_total[i] for i in members])  # [b]
        r = torch.arange(n_max)[None]  # [1, n_max]
        last = torch.minimum(r, new[:, None] - 1)  # [b, n_max]: padding repeats the chunk's last query
        q_rows = torch.tensor([starts[i] for i in members])[:, None] + last  # [b, n_max]
        q_pos = (total - new)[:, None] + last  # [b, n_max]
        mask = torch.arange(s_max)[None, None] <= q_pos[..., None]  # [b, n_max, s_max]
        d = self.device
        valid_pos = None
        if min(new_of) < n_max:  # padded query rows: where the real ones sit in the flattened [b * n_max]
            valid_pos = torch.tensor([j * n_max + q for j, m in enumerate(new_of) for q in range(m)], device=d)
        out_rows = torch.tensor([starts[i] + q for i in members for q in range(self.num_new[i])], device=d)
        return SdpaGroup(q_rows.to(d), self.read_slots[idx.to(d), :s_max], mask[:, None].to(d), valid_pos, out_rows)


def _cumsum(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)
