"""Packed variable-length sequences: the metadata varlen kernels take (cu_seqlens / seq_idx, as
mamba_ssm's and flash-attn's varlen interfaces do), plus the index layouts the torch references use.

n sequences are packed along dim 0 of a [T, ...] tensor; sequence i is rows cu_seqlens[i] : cu_seqlens[i+1]:

    lengths     [3, 1, 2]
    cu_seqlens  [0, 3, 4, 6]
    seq_idx     [0 0 0 1 2 2]

Layouts are built once per step (cached per kernel width / chunk size) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ConvLayout:
    """Depthwise causal conv of width K over packed sequences, each continuing from its own conv state.

    The extended buffer puts each sequence's K-1 state columns in front of its tokens:

        ext  [ s0 s0 s0 a0 a1 a2 | s1 s1 s1 b0 | s2 s2 s2 c0 c1 ]     K = 4
             rows of cat([states as [n*(K-1), C], x [T, C]]) gathered by `ext_rows`

    A conv without padding over `ext` gives token t of sequence i at output `out_cols` (its window lies
    inside its own segment), and the sequence's final state is `ext` rows `final_rows[i]`."""

    ext_rows: torch.Tensor  # int64 [T + n*(K-1)]: row of cat([states, x]) at each ext position
    out_cols: torch.Tensor  # int64 [T]: conv output column of each token
    final_rows: torch.Tensor  # int64 [n, K-1]: ext positions of each sequence's last K-1 inputs
    ext_seq_idx: torch.Tensor  # int32 [T + n*(K-1)]: sequence of each ext position (causal_conv1d_fn)


@dataclass(frozen=True)
class ChunkLayout:
    """SSD chunks aligned to sequence starts: sequence i takes ceil(L_i / chunk_size) whole chunks, so no
    chunk mixes two sequences. Padded positions read an all-zero row (dt = 0: no decay, no input)."""

    chunk_rows: torch.Tensor  # int64 [c * chunk_size]: packed row of each chunk position (T = the zero row)
    token_pos: torch.Tensor  # int64 [T]: position of each packed token in the chunk layout
    chunk_slot: torch.Tensor  # int64 [c]: index of each chunk in the padded [n * max_chunks] layout
    max_chunks: int


@dataclass(frozen=True)
class VarlenSeqs:
    """Lengths of n packed sequences and the tensors derived from them, on `device`."""

    lengths: tuple[int, ...]
    device: torch.device

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @cached_property
    def _lengths_cpu(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.long)

    @cached_property
    def _starts_cpu(self) -> torch.Tensor:
        return torch.cumsum(self._lengths_cpu, 0) - self._lengths_cpu  # [n]

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [n + 1]."""
        cu = torch.zeros(self.num_seqs + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(self._lengths_cpu, 0)
        return cu.to(self.device)

    @cached_property
    def _seq_idx_cpu(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.num_seqs), self._lengths_cpu, output_size=self.num_tokens)

    @cached_property
    def seq_idx(self) -> torch.Tensor:
        """int32 [T]: the sequence of every packed token."""
        return self._seq_idx_cpu.to(self.device, torch.int32)

    @cached_property
    def seq_idx_long(self) -> torch.Tensor:
        return self._seq_idx_cpu.to(self.device)

    @cached_property
    def _conv_layouts(self) -> dict[int, ConvLayout]:
        return {}

    @cached_property
    def _chunk_layouts(self) -> dict[int, ChunkLayout]:
        return {}

    def conv_layout(self, width: int) -> ConvLayout:
        if width not in self._conv_layouts:
            self._conv_layouts[width] = self._build_conv_layout(width)
        return self._conv_layouts[width]

    def chunk_layout(self, chunk_size: int) -> ChunkLayout:
        if chunk_size not in self._chunk_layouts:
            self._chunk_layouts[chunk_size] = self._build_chunk_layout(chunk_size)
        return self._chunk_layouts[chunk_size]

    def _build_conv_layout(self, width: int) -> ConvLayout:
        n, km1, T = self.num_seqs, width - 1, self.num_tokens
        lengths, starts = self._lengths_cpu, self._starts_cpu
        seg_len = lengths + km1  # [n]
        seg_start = starts + torch.arange(n) * km1  # [n]: ext position where segment i starts
        ext_seq = torch.repeat_interleave(torch.arange(n), seg_len, output_size=T + n * km1)  # [T + n*km1]
        offset = torch.arange(T + n * km1) - seg_start[ext_seq]  # position inside the segment
        state_row = ext_seq * km1 + offset  # rows 0 .. n*km1-1 of cat([states, x])
        token_row = n * km1 + starts[ext_seq] + offset - km1  # rows n*km1 .. of cat([states, x])
        ext_rows = torch.where(offset < km1, state_row, token_row)
        out_cols = seg_start[self._seq_idx_cpu] + torch.arange(T) - starts[self._seq_idx_cpu]  # [T]
        final_rows = (seg_start + lengths)[:, None] + torch.arange(km1)  # [n, km1]
        d = self.device
        return ConvLayout(ext_rows.to(d), out_cols.to(d), final_rows.to(d), ext_seq.to(d, torch.int32))

    def _build_chunk_layout(self, chunk_size: int) -> ChunkLayout:
        n, T = self.num_seqs, self.num_tokens
        lengths, starts = self._lengths_cpu, self._starts_cpu
        chunks_per_seq = [-(-length // chunk_size) for length in self.lengths]  # sizes from ints: no read
        num_chunks = torch.tensor(chunks_per_seq, dtype=torch.long)  # [n]
        max_chunks = max(chunks_per_seq, default=0)
        chunk_seq = torch.repeat_interleave(torch.arange(n), num_chunks, output_size=sum(chunks_per_seq))  # [c]
        first_chunk = torch.cumsum(num_chunks, 0) - num_chunks  # [n]
        chunk_in_seq = torch.arange(len(chunk_seq)) - first_chunk[chunk_seq]  # [c]
        pos_in_seq = (chunk_in_seq[:, None] * chunk_size + torch.arange(chunk_size)).flatten()  # [c*l]
        seq_of_pos = chunk_seq.repeat_interleave(chunk_size)  # [c*l]
        chunk_rows = torch.where(pos_in_seq < lengths[seq_of_pos], starts[seq_of_pos] + pos_in_seq, T)
        seq = self._seq_idx_cpu
        token_pos = first_chunk[seq] * chunk_size + torch.arange(T) - starts[seq]  # [T]
        chunk_slot = chunk_seq * max_chunks + chunk_in_seq  # [c]
        d = self.device
        return ChunkLayout(chunk_rows.to(d), token_pos.to(d), chunk_slot.to(d), max_chunks)
