"""Row gathers and scatters along dim 0, the moves every layer makes between a step's packed rows and the
cache pools (state slots, KV slots).

An index is a slice where the ids are consecutive (a view, no copy) or int64 ids. Scatters go through
`copy_rows_`: CPU `index_copy_` moves one element at a time, so rows whose bytes allow it are moved as
16-byte words instead (a bit-exact copy; 32 float32 Mamba states of 64 KB: 136 -> 45 us on one core).
Gathers need no such help: `index_select` already copies whole contiguous rows.
"""

from __future__ import annotations

import torch

Index = slice | torch.Tensor  # a slice where the ids are consecutive (a view, no gather), else int64 ids

_WORD = torch.complex128  # 16 bytes: the widest element an index copy moves at once


def as_index(ids: list[int]) -> Index:
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, dtype=torch.long)


# Below this many bytes a scatter is cheap either way and the three views of the word path cost more than
# they save (a 1-row scatter: 1.5 us as elements, ~10 us through the views)
_MIN_WORD_BYTES = 128 * 1024


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """t [n, ...] contiguous -> [n, row_bytes / 16] complex128 view of the same memory, or None when the
    rows' bytes or alignment do not allow it (then the caller copies element by element)."""
    row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
    if not t.is_contiguous() or row_bytes % 16 or t.data_ptr() % 16 or t.dtype.is_complex:
        return None
    return t.view(t.shape[0], -1).view(torch.uint8).view(_WORD)


def copy_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.index_copy_(0, index, src), src [n, *dst.shape[1:]] cast to dst's dtype; bit-identical, and
    faster on CPU for scatters of at least _MIN_WORD_BYTES."""
    src = src.to(dst.dtype)
    if dst.device.type == "cpu" and src.numel() * src.element_size() >= _MIN_WORD_BYTES:
        words, src_words = _as_words(dst), _as_words(src.contiguous())
        if words is not None and src_words is not None:
            words.index_copy_(0, index, src_words)
            return dst
    return dst.index_copy_(0, index, src)


def take(t: torch.Tensor, index: Index) -> torch.Tensor:
    """t[index] along dim 0 (index_select for ids: a much faster gather than advanced indexing on CPU)."""
    return t[index] if isinstance(index, slice) else t.index_select(0, index)


def put(t: torch.Tensor, index: Index, src: torch.Tensor) -> None:
    """t[index] = src along dim 0, in place."""
    if isinstance(index, slice):
        t[index] = src
    else:
        copy_rows_(t, index, src)
