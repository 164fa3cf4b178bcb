"""per_token_state_slots: the state after new token j equals a prefix run of length context + j + 1."""

from __future__ import annotations

import dataclasses

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


def _clone(caches):
    return dataclasses.replace(
        caches,
        kv={i: (k.clone(), v.clone()) for i, (k, v) in caches.kv.items()},
        conv={i: t.clone() for i, t in caches.conv.items()},
        ssm={i: t.clone() for i, t in caches.ssm.items()},
    )


def test_one_pass_verify_equals_token_by_token_steps(model):
    """Verify chunks (two of length 4 batched together, a fresh one of length 2) in one pass per Mamba
    layer == the token-by-token path: 1-token decode steps, the state copied out after each."""
    seqs = [  # (context, new, state slot, per-token slots or None)
        (30, 4, 0, (9, 3, 7, 5)),
        (20, 4, 1, (10, 11, 12, 13)),
        (0, 2, 2, (14, 15)),
        (10, 1, 4, None),  # a decode
        (0, 5, 6, None),  # a prefill
    ]
    caches = model.allocate_caches(32, 16, 16)
    ids = [make_tokens(ctx + new, seed=20 + s) for s, (ctx, new, _, _) in enumerate(seqs)]
    tables = [torch.arange(4 * s, 4 * s + 3) for s in range(len(seqs))]
    for (ctx, _, slot, _), seq, table in zip(seqs, ids, tables):
        if ctx:
            run_chunks(model, caches, seq[:ctx], [ctx], table, slot=slot)
    ref = _clone(caches)
    for ssm in caches.ssm.values():
        ssm[2].normal_()  # stale contents of the fresh chunk's slot must be ignored
    chunks = tuple(SeqChunk(ctx, new, table, slot, per) for (ctx, new, slot, per), table in zip(seqs, tables))
    batch = ForwardBatch(torch.cat([seq[ctx:] for (ctx, *_), seq in zip(seqs, ids)]), chunks)
    logits = model.compute_logits(model.forward(batch, caches))

    ref_logits = []
    for (ctx, new, slot, per), seq, table in zip(seqs, ids, tables):
        if per is None:
            ref_logits.append(run_chunks(model, ref, seq[ctx:], [new], table, slot=slot, start=ctx))
            continue
        for j, dst in enumerate(per):
            ref_logits.append(run_chunks(model, ref, seq[ctx + j : ctx + j + 1], [1], table, slot, ctx + j))
            ref.copy_state(slot, dst)
    torch.testing.assert_close(logits, torch.cat(ref_logits), atol=ATOL, rtol=0)
    for layer in caches.conv:
        for s in range(16):
            torch.testing.assert_close(caches.conv[layer][s], ref.conv[layer][s], atol=1e-5, rtol=0)
            torch.testing.assert_close(caches.ssm[layer][s], ref.ssm[layer][s], atol=1e-5, rtol=0)
