"""copy_rows_: a scatter along dim 0 that moves wide rows as 16-byte words must equal index_copy_ bit for bit."""

from __future__ import annotations

import pytest
import torch

import workers.model.rows as rows
from workers.model.rows import _as_words, copy_rows_, put


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((20, 4, 3, 8), torch.float32),  # Mamba state rows (word path)
        ((20, 6, 3), torch.float32),  # conv state rows: 72 bytes, not a multiple of 16 (element path)
        ((20, 2, 8), torch.bfloat16),  # KV rows in bf16: 32 bytes (word path)
        ((20, 5), torch.float16),  # 10-byte rows (element path)
    ],
)
@pytest.mark.parametrize("min_word_bytes", [0, rows._MIN_WORD_BYTES])  # 0: small scatters take the word path too
def test_copy_rows_equals_index_copy_bit_for_bit(shape, dtype, min_word_bytes, monkeypatch):
    monkeypatch.setattr(rows, "_MIN_WORD_BYTES", min_word_bytes)
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(*shape, generator=g).to(dtype)
    index = torch.tensor([7, 0, 19, 3, 12])
    src = torch.randn(5, *shape[1:], generator=g, dtype=torch.float64)  # cast to the pool's dtype on the way
    want = pool.clone().index_copy_(0, index, src.to(dtype))
    assert torch.equal(copy_rows_(pool.clone(), index, src), want)
    strided = torch.zeros(10, *shape[1:], dtype=torch.float64)
    strided[::2] = src  # every other row of a bigger tensor: not contiguous
    assert torch.equal(copy_rows_(pool.clone(), index, strided[::2]), want)

def test_the_word_path_is_taken_for_wide_aligned_rows_and_never_for_narrow_or_offset_ones():
    """The speed-up is real only if the 16-byte view is used; a misaligned view must never be."""
    pool = torch.zeros(10, 16, 8, 8)
    words = _as_words(pool)
    assert words is not None and words.dtype == torch.complex128 and words.shape == (10, 16 * 8 * 8 * 4 // 16)
    assert _as_words(torch.zeros(10, 6, 3)) is None  # 72-byte rows
    offset = torch.zeros(10 * 64 + 1)[1:].view(10, 64)  # data pointer 4 bytes past alignment
    assert _as_words(offset) is None
    assert _as_words(pool.transpose(1, 2)) is None  # not contiguous


def test_a_wide_scatter_goes_through_the_word_view(monkeypatch):
    """32 Mamba-state-sized rows (2 MB) must take the 16-byte path: with it disabled the copy is 3x slower."""
    calls = []
    real = rows._as_words
    monkeypatch.setattr(rows, "_as_words", lambda t: calls.append(t.shape) or real(t))
    pool = torch.zeros(40, 16, 32, 32)
    copy_rows_(pool, torch.arange(32), torch.ones(32, 16, 32, 32))
    assert calls and pool[:32].eq(1).all() and pool[32:].eq(0).all()
    calls.clear()
    copy_rows_(pool, torch.tensor([3]), torch.ones(1, 16, 32, 32))  # 64 KB: element path, no views
    assert not calls


def test_put_with_ids_and_with_a_slice():
    t = torch.zeros(6, 4)
    put(t, torch.tensor([4, 1]), torch.ones(2, 4))
    put(t, slice(2, 3), torch.full((1, 4), 2.0))
    assert t[:, 0].tolist() == [0, 1, 2, 0, 1, 0]
