"""per_token_state_slots: the state after new token j equals a prefix run of length context + j + 1."""

from __future__ import annotations

import torch

from tests.model.helpers import make_table, make_tokens, run_chunks
from workers.model.forward_batch import ForwardBatch, SeqChunk

ATOL = 1e-4


def _prefix_state(model, ids):
    caches = model.allocate_caches(8, 16, 1)
    run_chunks(model, caches, ids, [len(ids)], make_table(7, 0, 8), slot=0)
    return {i: (caches.conv[i][0].clone(), caches.ssm[i][0].clone()) for i in caches.conv}


def test_verify_chunk_writes_state_after_every_token(model):
    ids = make_tokens(44, seed=8)
    ctx, k1 = 40, 4
    caches = model.allocate_caches(8, 16, 8)
    table = make_table(3, 1, 8)
    run_chunks(model, caches, ids[:ctx], [ctx], table, slot=0)
    verify = SeqChunk(ctx, k1, table, 0, per_token_state_slots=(3, 4, 5, 6))
    batch = ForwardBatch(
        torch.cat([ids[ctx:], make_tokens(2, seed=9)]), (verify, SeqChunk(0, 2, make_table(8, 2, 8)[-1:], 7))
    )  # + another sequence
    logits = model.compute_logits(model.forward(batch, caches))
    for j, slot in enumerate(verify.per_token_state_slots):
        ref = _prefix_state(model, ids[: ctx + j + 1])
        for layer, (conv, ssm) in ref.items():
            torch.testing.assert_close(caches.conv[layer][slot], conv, atol=ATOL, rtol=0)
            torch.testing.assert_close(caches.ssm[layer][slot], ssm, atol=ATOL, rtol=0)
    final = _prefix_state(model, ids)
    for layer, (conv, ssm) in final.items():  # state_slot holds the state after the whole chunk
        torch.testing.assert_close(caches.ssm[layer][0], ssm, atol=ATOL, rtol=0)
        torch.testing.assert_close(caches.conv[layer][0], conv, atol=ATOL, rtol=0)
    ref_caches = model.allocate_caches(8, 16, 1)
    ref_logits = run_chunks(model, ref_caches, ids, [44], make_table(3, 0, 8), slot=0)
    torch.testing.assert_close(logits[:k1], ref_logits[ctx:], atol=ATOL, rtol=0)


def test_rollback_to_accepted_slot_continues_exactly(model):
    """Engine rollback: accept 2 of 4 verified tokens -> copy slot 2's state back and continue."""
    ids = make_tokens(30, seed=12)
    caches = model.allocate_caches(4, 16, 6)
    table = make_table(2, 3, 4)
    run_chunks(model, caches, ids[:20], [20], table, slot=0)
    wrong = make_tokens(2, seed=77)
    chunk = SeqChunk(20, 4, table, 0, per_token_state_slots=(1, 2, 3, 4))
    model.forward(ForwardBatch(torch.cat([ids[20:22], wrong]), (chunk,)), caches)
    caches.copy_state(2, 0)  # state after ids[:22]
    got = run_chunks(model, caches, ids[22:], [8], table, slot=0, start=22)  # overwrites stale KV at 22, 23
    ref_caches = model.allocate_caches(4, 16, 1)
    ref = run_chunks(model, ref_caches, ids, [30], table, slot=0)
    torch.testing.assert_close(got, ref[22:], atol=ATOL, rtol=0)


def test_context_zero_per_token_chunk(model):
    ids = make_tokens(3, seed=4)
    caches = model.allocate_caches(2, 16, 4)
    for ssm in caches.ssm.values():
        ssm.normal_()  # stale garbage must be ignored at context 0
    model.forward(ForwardBatch(ids, (SeqChunk(0, 3, make_table(1, 0, 2), 0, (1, 2, 3)),)), caches)
    ref = _prefix_state(model, ids[:2])
    for layer, (_, ssm) in ref.items():
        torch.testing.assert_close(caches.ssm[layer][2], ssm, atol=ATOL, rtol=0)
