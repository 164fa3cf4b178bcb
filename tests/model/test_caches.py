"""Cache allocation, byte-size helpers, copy_state, and ForwardBatch validation errors."""

from __future__ import annotations

import pytest
import torch

from workers.model.errors import ForwardBatchError
from workers.model.forward_batch import ForwardBatch, SeqChunk


def test_shapes_and_bytes(model):
    cfg = model.config
    caches = model.allocate_caches(5, 16, 3, num_draft_blocks=4, draft_block_size=8)
    assert set(caches.kv) == set(cfg.attention_layer_ids) and set(caches.conv) == set(cfg.mamba_layer_ids)
    assert caches.kv[3][0].shape == (5, 16, 2, 64)
    assert caches.conv[0].shape == (3, cfg.conv_dim, 3) and caches.ssm[0].shape == (3, 16, 32, 32)
    assert caches.draft_kv[0][0].shape == (4, 8, 2, 64)
    assert model.kv_bytes_per_block(16) == caches.kv_bytes_per_block() == 2 * 2 * 16 * 2 * 64 * 4
    assert model.state_bytes_per_slot() == caches.state_bytes_per_slot() == 4 * 4 * (640 * 3 + 16 * 32 * 32)
    assert model.draft_kv_bytes_per_block(8) == caches.draft_kv_bytes_per_block() == 2 * 8 * 2 * 64 * 4


def test_copy_state_copies_every_mamba_layer(model):
    caches = model.allocate_caches(1, 16, 3)
    for layer in caches.conv:
        caches.conv[layer][0].normal_()
        caches.ssm[layer][0].normal_()
    caches.copy_state(0, 2)
    for layer in caches.conv:
        assert torch.equal(caches.conv[layer][2], caches.conv[layer][0])
        assert torch.equal(caches.ssm[layer][2], caches.ssm[layer][0])
        assert not caches.ssm[layer][1].any()


def test_copy_states_equals_copy_state_pair_by_pair(model):
    """The batched copy reads every source before writing (a destination may be another pair's
    source) and equals copy_state pair by pair when no pair reads an earlier pair's destination."""
    caches = model.allocate_caches(1, 16, 6)
    ref = model.allocate_caches(1, 16, 6)
    for layer in caches.conv:
        for pool, ref_pool in ((caches.conv, ref.conv), (caches.ssm, ref.ssm)):
            pool[layer].normal_()
            ref_pool[layer].copy_(pool[layer])
    caches.copy_states([4, 0, 5], [1, 3, 2])
    for src, dst in ((4, 1), (0, 3), (5, 2)):
        ref.copy_state(src, dst)
    for layer in caches.conv:
        assert torch.equal(caches.conv[layer], ref.conv[layer]) and torch.equal(caches.ssm[layer], ref.ssm[layer])
    before = caches.ssm[next(iter(caches.ssm))].clone()
    caches.copy_states([1, 2], [2, 1])  # a swap: sources read first
    after = caches.ssm[next(iter(caches.ssm))]
    assert torch.equal(after[1], before[2]) and torch.equal(after[2], before[1])
    with pytest.raises(ValueError, match="distinct destinations"):
        caches.copy_states([0, 1], [2, 2])


@pytest.mark.parametrize(
    ("chunks", "ids", "match"),
    [
        ((SeqChunk(0, 3, torch.tensor([0]), 0),), 2, "3 new tokens but input_ids has 2"),
        ((SeqChunk(10, 8, torch.tensor([0]), 0),), 8, "need 2 of 16"),
        ((SeqChunk(0, 2, torch.tensor([9]), 0),), 2, "outside pool"),
        ((SeqChunk(0, 2, torch.tensor([0]), 5),), 2, "state slot 5 outside"),
        ((SeqChunk(0, 1, torch.tensor([0]), 1), SeqChunk(0, 1, torch.tensor([1]), 1)), 2, "used twice"),
        ((SeqChunk(0, 2, torch.tensor([0]), 0, (1,)),), 2, "per_token_state_slots"),
        ((), 0, "at least one chunk"),
    ],
)
def test_batch_validation(model, chunks, ids, match):
    caches = model.allocate_caches(4, 16, 3)
    with pytest.raises(ForwardBatchError, match=match):
        model.forward(ForwardBatch(torch.zeros(ids, dtype=torch.long), chunks), caches)


def test_forward_counts_rows_and_declared_prompt_rows_and_tp_commands_carry_them(model):
    from workers.model.tp_commands import decode_batch, encode_batch

    caches = model.allocate_caches(4, 16, 3)
    chunks = (SeqChunk(0, 5, torch.tensor([0]), 0), SeqChunk(7, 1, torch.tensor([1]), 1))
    with pytest.raises(ForwardBatchError, match="num_prompt_tokens=7 outside"):
        model.forward(ForwardBatch(torch.zeros(6, dtype=torch.long), chunks, 7), caches)
    batch = ForwardBatch(torch.arange(6), chunks, 5)  # a 5-token prefill chunk next to a decode
    assert decode_batch(encode_batch(batch)).num_prompt_tokens == 5  # what rank > 0 counts
    before = model.forward_counts
    model.forward(batch, caches)
    after = model.forward_counts
    assert (after.num_tokens - before.num_tokens, after.num_prompt_tokens - before.num_prompt_tokens) == (6, 5)
