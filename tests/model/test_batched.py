"""Continuous batching: several sequences in one ForwardBatch equal running each alone."""

from __future__ import annotations

import torch

from tests.model.helpers import make_table, make_tokens, run_chunks
from workers.model.forward_batch import ForwardBatch, SeqChunk

ATOL = 1e-4


def test_two_prefills_in_one_batch(model):
    a, b = make_tokens(70, seed=1), make_tokens(33, seed=2)
    ref_caches = model.allocate_caches(16, 16, 2)
    ref_a = run_chunks(model, ref_caches, a, [70], make_table(5, 0, 16), slot=0)
    ref_b = run_chunks(model, ref_caches, b, [33], make_table(3, 1, 16), slot=1)
    caches = model.allocate_caches(16, 16, 4)
    perm = make_table(16, 5, 16)
    batch = ForwardBatch(torch.cat([a, b]), (SeqChunk(0, 70, perm[:5], 3), SeqChunk(0, 33, perm[5:8], 0)))
    got = model.compute_logits(model.forward(batch, caches))
    torch.testing.assert_close(got[:70], ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[70:], ref_b, atol=ATOL, rtol=0)


def test_mixed_prefill_decode_and_fresh_single_token(model):
    """Batch = [decode of A at 40 | prefill chunk of B from 20 | 1-token fresh C | decode of D at 7]."""
    seqs = {
        name: make_tokens(n, seed=i) for i, (name, n) in enumerate([("A", 41), ("B", 50), ("C", 1), ("D", 8)])
    }
    alone = {}
    for name, ids in seqs.items():
        caches = model.allocate_caches(8, 16, 1)
        alone[name] = run_chunks(model, caches, ids, [len(ids)], make_table(4, 0, 8), slot=0)

    caches = model.allocate_caches(32, 16, 6)
    perm = make_table(32, 3, 32)
    tables = {"A": perm[0:4], "B": perm[4:8], "C": perm[8:9], "D": perm[9:10]}
    slots = {"A": 5, "B": 0, "C": 2, "D": 4}
    run_chunks(model, caches, seqs["A"][:40], [40], tables["A"], slots["A"])
    run_chunks(model, caches, seqs["B"][:20], [20], tables["B"], slots["B"])
    run_chunks(model, caches, seqs["D"][:7], [3, 4], tables["D"], slots["D"])
    chunks = (
        SeqChunk(40, 1, tables["A"], slots["A"]),
        SeqChunk(20, 30, tables["B"], slots["B"]),
        SeqChunk(0, 1, tables["C"], slots["C"]),
        SeqChunk(7, 1, tables["D"], slots["D"]),
    )
    ids = torch.cat([seqs["A"][40:], seqs["B"][20:], seqs["C"], seqs["D"][7:]])
    got = model.compute_logits(model.forward(ForwardBatch(ids, chunks), caches))
    torch.testing.assert_close(got[0], alone["A"][40], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1:31], alone["B"][20:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[31], alone["C"][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[32], alone["D"][7], atol=ATOL, rtol=0)
    # and the states left behind continue each sequence correctly
    nxt = make_tokens(1, seed=50)
    after = run_chunks(model, caches, nxt, [1], tables["B"], slots["B"], start=50)
    ref_caches = model.allocate_caches(8, 16, 1)
    ref = run_chunks(model, ref_caches, torch.cat([seqs["B"], nxt]), [51], make_table(4, 0, 8), slot=0)
    torch.testing.assert_close(after[0], ref[-1], atol=ATOL, rtol=0)
