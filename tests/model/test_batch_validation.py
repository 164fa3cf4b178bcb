"""ForwardBatch.validate's whole-batch checks must accept exactly the batches the chunk-by-chunk checks
accept (the fast path may never let an inconsistent batch through, nor refuse a valid one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.model.errors import ForwardBatchError
from workers.model.forward_batch import ForwardBatch, SeqChunk

BLOCK, NUM_BLOCKS, NUM_SLOTS = 4, 12, 6


@st.composite
def chunks(draw):
    context = draw(st.integers(-1, 9))
    new = draw(st.integers(0, 4))
    need = max(0, -(-(context + new) // BLOCK))
    extra = draw(st.integers(-1, 2))  # a table one short, exact, or longer than needed
    table = draw(st.lists(st.integers(-1, NUM_BLOCKS), min_size=max(0, need + extra), max_size=max(0, need + extra)))
    slot = draw(st.integers(-1, NUM_SLOTS))
    per_token = draw(st.none() | st.lists(st.integers(-1, NUM_SLOTS), min_size=max(new - 1, 0), max_size=new + 1))
    return SeqChunk(context, new, torch.tensor(table, dtype=torch.long), slot,
                    None if per_token is None else tuple(per_token))


def _slow_raises(batch: ForwardBatch, sizes) -> bool:
    try:
        batch._raise_for_invalid_chunk(*sizes)
    except ForwardBatchError:
        return True
    return False


@settings(max_examples=400, deadline=None)
@given(st.lists(chunks(), min_size=1, max_size=5), st.sampled_from([
    (BLOCK, NUM_BLOCKS, NUM_SLOTS), (BLOCK, None, NUM_SLOTS), (None, None, NUM_SLOTS), (BLOCK, NUM_BLOCKS, None),
]))
def test_whole_batch_checks_agree_with_the_chunk_by_chunk_ones(chunk_list, sizes):
    batch = ForwardBatch(torch.zeros(sum(max(c.num_new_tokens, 0) for c in chunk_list), dtype=torch.long),
                         tuple(chunk_list))
    assert batch._chunks_look_valid(*sizes) == (not _slow_raises(batch, sizes))


def test_a_bad_block_id_past_a_chunks_need_is_ignored_and_one_inside_is_named():
    ok = SeqChunk(0, 4, torch.tensor([1, 99]), 0)  # needs 1 block of 4; the 99 is never read
    bad = SeqChunk(0, 5, torch.tensor([2, 99]), 1)  # needs 2: the 99 is read
    ForwardBatch(torch.zeros(4, dtype=torch.long), (ok,)).validate(BLOCK, NUM_BLOCKS, NUM_SLOTS)
    with pytest.raises(ForwardBatchError, match=r"chunk 1: block ids \[2, 99\] outside pool of 12"):
        ForwardBatch(torch.zeros(9, dtype=torch.long), (ok, bad)).validate(BLOCK, NUM_BLOCKS, NUM_SLOTS)
