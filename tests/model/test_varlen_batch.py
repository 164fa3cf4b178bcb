"""One varlen forward per step: a batch mixing prefill chunks (fresh and continuing, crossing SSD chunk
boundaries), decodes and verify chunks of different context lengths equals running every chunk alone,
logits and every cache tensor, in fp32 (tight) and bf16 (within bf16 rounding); and the kernels really
run once per layer over the whole batch (not once per chunk)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.helpers import make_table, make_tokens, run_chunks
from workers.model.caches import ModelCaches
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.kernels import TORCH_KERNELS, KernelSet
from workers.model.loader import load_model
from workers.model.paged_plan import PagedPlan

SEQS = [  # (context, new, state slot, per-token slots or None)
    (0, 70, 3, None),  # fresh prefill crossing the 64-token SSD chunk
    (20, 45, 0, None),  # continuing prefill
    (0, 1, 5, None),  # fresh 1-token chunk (decode path, zero state)
    (40, 1, 1, None),  # decode
    (100, 1, 7, None),  # decode, longer context
    (30, 4, 2, (9, 10, 11, 12)),  # verify
    (12, 4, 4, (13, 14, 15, 16)),  # verify of the same length (one group)
    (50, 3, 6, (17, 18, 19)),  # verify of another length
    (7, 130, 8, None),  # long continuing prefill from a context that is not block aligned
]
NUM_BLOCKS, BLOCKS_PER_SEQ, NUM_SLOTS = 96, 9, 20


def _clone(c: ModelCaches) -> ModelCaches:
    return ModelCaches(
        kv={i: (k.clone(), v.clone()) for i, (k, v) in c.kv.items()},
        conv={i: t.clone() for i, t in c.conv.items()},
        ssm={i: t.clone() for i, t in c.ssm.items()},
    )


def _setup(model):
    """Caches holding every sequence's context (stale garbage in the fresh chunks' slots) and the batch."""
    caches = model.allocate_caches(NUM_BLOCKS, 16, NUM_SLOTS)
    perm = make_table(NUM_BLOCKS, 0, NUM_BLOCKS)
    tables = [perm[BLOCKS_PER_SEQ * i : BLOCKS_PER_SEQ * (i + 1)] for i in range(len(SEQS))]
    ids = [make_tokens(ctx + new, seed=i) for i, (ctx, new, _, _) in enumerate(SEQS)]
    for (ctx, _, slot, _), seq, table in zip(SEQS, ids, tables):
        if ctx:
            run_chunks(model, caches, seq[:ctx], [ctx], table, slot)
    for (ctx, _, slot, _) in SEQS:
        if ctx == 0:
            for layer in caches.conv:
                caches.conv[layer][slot].fill_(float("nan"))  # must be read as zeros, never touched
                caches.ssm[layer][slot].normal_()
    chunks = tuple(SeqChunk(ctx, new, t, slot, per) for (ctx, new, slot, per), t in zip(SEQS, tables))
    return caches, chunks, [seq[ctx:] for (ctx, *_), seq in zip(SEQS, ids)]


def _batched_and_alone(model):
    caches, chunks, new_ids = _setup(model)
    alone_caches = _clone(caches)
    got = model.compute_logits(model.forward(ForwardBatch(torch.cat(new_ids), chunks), caches))
    want = torch.cat([
        model.compute_logits(model.forward(ForwardBatch(ids, (chunk,)), alone_caches))
        for chunk, ids in zip(chunks, new_ids)
    ])
    return got, want, caches, alone_caches


def _assert_caches_close(a: ModelCaches, b: ModelCaches, **tol) -> None:
    for layer, (k, v) in a.kv.items():
        torch.testing.assert_close(k, b.kv[layer][0], **tol)
        torch.testing.assert_close(v, b.kv[layer][1], **tol)
    for layer in a.conv:
        torch.testing.assert_close(a.conv[layer], b.conv[layer], equal_nan=True, **tol)
        torch.testing.assert_close(a.ssm[layer], b.ssm[layer], **tol)


def test_mixed_batch_equals_each_chunk_alone_fp32(model):
    got, want, caches, alone = _batched_and_alone(model)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    _assert_caches_close(caches, alone, atol=2e-5, rtol=1e-5)


@pytest.mark.heavy
def test_mixed_batch_equals_each_chunk_alone_bf16(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.bfloat16, kernels="torch")
    got, want, caches, alone = _batched_and_alone(model)
    scale = want.abs().max()
    # bf16 keeps 8 bits: batched vs alone may round a few activations differently, nothing more
    assert (got - want).abs().max() <= 2**-6 * scale, float((got - want).abs().max())
    # the same greedy token in every row, but for near ties: where the argmax differs, the two
    # candidates' logits are within the tolerance above on both sides (bf16 GEMM kernels, e.g. AMX,
    # round by batch shape), and such rows are rare
    tol = 2**-6 * scale
    differ = (got.argmax(-1) != want.argmax(-1)).nonzero().flatten().tolist()
    for row in differ:
        a, b = int(got[row].argmax()), int(want[row].argmax())
        assert want[row, b] - want[row, a] <= tol and got[row, a] - got[row, b] <= tol, (row, a, b)
    assert len(differ) <= max(1, got.shape[0] // 50), differ
    _assert_caches_close(caches, alone, atol=2**-6, rtol=2**-6)


def _counting(kernels: KernelSet, calls: dict[str, list]) -> KernelSet:
    def wrap(name):
        fn = getattr(kernels, name)

        def counted(*args):
            calls.setdefault(name, []).append(args)
            return fn(*args)
        return counted

    names = ("ssd_scan", "conv1d", "conv1d_update", "state_update", "attention")
    return dataclasses.replace(kernels, **{n: wrap(n) for n in names})


def test_each_layer_runs_its_kernels_once_over_the_whole_batch(tiny_dir):
    model = load_model(tiny_dir, kernels="torch")
    calls: dict[str, list] = {}
    counting = _counting(TORCH_KERNELS, calls)
    for block in model.model.layers:
        if hasattr(block.mixer, "kernels"):
            block.mixer.kernels = counting
    caches, chunks, new_ids = _setup(model)
    calls.clear()  # the context prefills above went through the same kernels
    model.forward(ForwardBatch(torch.cat(new_ids), chunks), caches)
    num_mamba, num_attn = len(model.config.mamba_layer_ids), len(model.config.attention_layer_ids)
    num_prefill = sum(1 for ctx, new, _, per in SEQS if per is None and new > 1)
    num_decode = sum(1 for ctx, new, _, per in SEQS if per is None and new == 1)
    assert len(calls["ssd_scan"]) == len(calls["conv1d"]) == num_mamba
    assert all(args[7].lengths == (70, 45, 130) for args in calls["ssd_scan"])  # seqs: all prefills
    assert all(args[9] == (1, 2) for args in calls["ssd_scan"])  # with_state: the continuing ones
    assert len(calls["state_update"]) == len(calls["conv1d_update"]) == num_mamba
    assert all(args[1].numel() == num_decode for args in calls["state_update"])  # one batched step
    assert len(calls["attention"]) == num_attn
    assert num_prefill == 3


def test_sdpa_groups_batch_decodes_together_and_keep_long_prefills_apart():
    table = torch.arange(40)
    decodes = [SeqChunk(100 + 7 * i, 1, table, i) for i in range(32)]
    batch = ForwardBatch(torch.zeros(32 + 512, dtype=torch.long), (*decodes, SeqChunk(0, 512, table, 40)))
    plan = PagedPlan.build(batch, 16, "cpu")
    sizes = sorted(g.mask.shape[0] for g in plan.sdpa_groups)
    assert sizes == [1, 32]  # 32 decodes in one SDPA call; the prefill does not pad them to 512 queries
    rows = torch.cat([g.out_rows for g in plan.sdpa_groups])
    assert sorted(rows.tolist()) == list(range(32 + 512))  # every query row written exactly once
