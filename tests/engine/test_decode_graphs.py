"""Decode graphs (workers/model/decode_graphs.py) on the CPU through EagerReplay: buckets, which steps
qualify, padding onto scratch pages, static buffers holding exactly the eager step's inputs, and engine
outputs unchanged (k=0, MTP k=3, warm == cold). The CUDA capture itself needs a GPU and is not run here."""

import pytest
import torch

from tests.conftest import make_engine, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError
from workers.engine.sampling_params import SamplingParams
from workers.model.decode_graphs import (
    DecodeGraphs,
    EagerReplay,
    bucket_for,
    default_batch_buckets,
    default_key_buckets,
)
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.paged_plan import PagedPlan


def test_buckets():
    assert default_batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_buckets(6) == (1, 2, 4, 6)
    assert default_key_buckets(16, 100) == (16, 32, 64, 112)
    assert default_key_buckets(16, 64) == (16, 32, 64)
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_config_flag_is_checked():
    assert EngineConfig().cuda_graphs == "off"
    with pytest.raises(EngineConfigError, match="on or off"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(EngineConfigError, match="needs a CUDA device"):
        EngineConfig(cuda_graphs="on", device="cpu")


def _graphs(tiny_model, caches):
    return DecodeGraphs(tiny_model, caches, EagerReplay(), (1, 2, 4), (16, 32, 64), scratch_block=9, scratch_slot=7)


def test_which_steps_qualify(tiny_model):
    graphs = _graphs(tiny_model, tiny_model.allocate_caches(10, 16, 8))
    t = torch.tensor([0, 1, 2, 3])

    def batch(*chunks):
        return ForwardBatch(torch.zeros(sum(c.num_new_tokens for c in chunks), dtype=torch.long), chunks)

    assert graphs.buckets(batch(SeqChunk(20, 1, t, 0), SeqChunk(40, 1, t, 1), SeqChunk(5, 1, t, 2))) == (1, 4, 64)
    assert graphs.buckets(batch(SeqChunk(5, 1, t, 0))) == (1, 1, 16)
    assert graphs.buckets(batch(SeqChunk(5, 2, t, 0))) is None  # a prefill chunk
    assert graphs.buckets(batch(SeqChunk(5, 2, t, 0, (3, 4)), SeqChunk(9, 2, t, 1, (5, 6)))) == (2, 2, 16)  # verifies
    assert graphs.buckets(batch(SeqChunk(5, 2, t, 0, (3, 4)), SeqChunk(9, 1, t, 1))) is None  # verify + decode
    assert graphs.buckets(batch(SeqChunk(5, 3, t, 0, (3, 4, 5)), SeqChunk(9, 2, t, 1, (5, 6)))) is None  # lengths
    assert graphs.buckets(batch(SeqChunk(0, 1, t, 0))) is None  # fresh: its state would be zeroed
    assert graphs.buckets(batch(SeqChunk(64, 1, t, 0))) is None  # 65 positions: past the key buckets
    assert graphs.buckets(batch(*(SeqChunk(5, 1, t, s) for s in range(5)))) is None  # 5 rows > 4


def test_padded_inputs_equal_the_eager_plan_and_padding_touches_only_scratch(tiny_model):
    caches = tiny_model.allocate_caches(10, 16, 8)
    graphs = _graphs(tiny_model, caches)
    chunks = (SeqChunk(20, 1, torch.tensor([3, 1]), 4), SeqChunk(33, 1, torch.tensor([0, 5, 2]), 2),
              SeqChunk(3, 1, torch.tensor([8]), 0))
    batch = ForwardBatch(torch.tensor([11, 12, 13]), chunks)
    ids, plan, slots = graphs.inputs(batch, 1, 4, 64)
    eager = PagedPlan.build(batch, 16, "cpu")
    assert ids.tolist() == [11, 12, 13, 0] and [s.tolist() for s in slots] == [[4, 2, 0, 7]]
    assert plan.write_slots[:3].tolist() == eager.write_slots.tolist()
    assert plan.write_slots[3].item() == 9 * 16 + 1  # the padding row writes position 1 of the scratch block
    assert plan.positions.tolist() == [*eager.positions.tolist(), 1]
    (group,) = plan.sdpa_groups
    assert group.key_slots.shape == (4, 64) and group.mask.shape == (4, 1, 1, 64)
    for i, c in enumerate(chunks):
        n = c.num_total_tokens
        assert group.mask[i, 0, 0].tolist() == [True] * n + [False] * (64 - n)
        assert group.key_slots[i, :n].tolist() == eager.read_slots[i, :n].tolist()
    # a graph's static buffers hold exactly these inputs after a load
    graph = graphs._capture(1, 4, 64)
    graph.load(ids, plan, slots)
    assert torch.equal(graph.input_ids, ids) and torch.equal(graph.mamba_slots[0], slots[0])
    assert torch.equal(graph.plan.write_slots, plan.write_slots) and torch.equal(graph.plan.positions, plan.positions)
    assert torch.equal(graph.plan.sdpa_groups[0].key_slots, group.key_slots)
    assert torch.equal(graph.plan.sdpa_groups[0].mask, group.mask)


def test_padded_verify_plan_equals_the_eager_plan():
    chunks = (SeqChunk(20, 3, torch.tensor([3, 1]), 4, (5, 6, 1)),
              SeqChunk(30, 3, torch.tensor([0, 5, 2]), 2, (3, 7, 0)))
    batch = ForwardBatch(torch.arange(6), chunks)
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # only the padding and plan logic: no model needed
    graphs.scratch_block, graphs.scratch_slot, graphs.block_size = 9, 8, 16
    padded = graphs.pad(batch, 3, 4)
    assert padded.input_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0]
    assert padded.chunks[2:] == padded.chunks[2:3] * 2 and padded.chunks[2].per_token_state_slots == (8, 8, 8)
    plan = PagedPlan.build_padded_decode(padded, 16, "cpu", 64)
    eager = PagedPlan.build(batch, 16, "cpu")
    assert plan.write_slots[:6].tolist() == eager.write_slots.tolist()
    assert plan.positions[:6].tolist() == eager.positions.tolist()
    assert set(plan.write_slots[6:].tolist()) <= set(range(9 * 16, 10 * 16))  # padding: the scratch block only
    (group,) = plan.sdpa_groups
    assert group.mask.shape == (4, 1, 3, 64)
    for i, c in enumerate(chunks):
        for r in range(3):  # query r sees positions [0, context + r]
            assert group.mask[i, 0, r].tolist() == [p <= c.num_context_tokens + r for p in range(64)]


@pytest.mark.parametrize("verify", [False, True])
def test_graph_step_equals_the_eager_forward(tiny_model, verify):
    """The same decode (or verify) batch from the same cache state: hidden rows through the padded graph
    path equal the eager forward's (up to the GEMM's row count), and the real pages end up the same."""
    g = torch.Generator().manual_seed(0)
    ref_caches, caches = tiny_model.allocate_caches(10, 16, 8), tiny_model.allocate_caches(10, 16, 8)
    for pools in ((ref_caches.conv, caches.conv), (ref_caches.ssm, caches.ssm)):
        for layer in pools[0]:
            pools[0][layer].copy_(torch.randn(pools[0][layer].shape, generator=g))
            pools[1][layer].copy_(pools[0][layer])
    for layer in ref_caches.kv:
        for a, b in zip(ref_caches.kv[layer], caches.kv[layer]):
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(a)
    chunks = (SeqChunk(20, 1, torch.tensor([3, 1]), 4), SeqChunk(33, 1, torch.tensor([0, 5, 2]), 2))
    if verify:
        chunks = (SeqChunk(20, 3, torch.tensor([3, 1]), 4, (5, 6, 1)),
                  SeqChunk(33, 3, torch.tensor([0, 5, 2]), 2, (3, 0, 2)))
    batch = ForwardBatch(torch.arange(11, 11 + sum(c.num_new_tokens for c in chunks)), chunks)
    want = tiny_model.forward(batch, ref_caches)
    graphs = _graphs(tiny_model, caches)
    got = graphs.run(batch)
    assert got.shape == want.shape and graphs.num_replays == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in ref_caches.ssm:
        for slot in range(7):
            torch.testing.assert_close(caches.ssm[layer][slot], ref_caches.ssm[layer][slot], atol=1e-6, rtol=1e-5)


def test_draft_graph_step_equals_the_eager_mtp_forward(tiny_model):
    """The MTP head's 1-token draft steps through a draft graph (prev hidden as a static input, the draft
    pool's scratch block): equal to its eager forward, the draft KV written alike."""
    g = torch.Generator().manual_seed(2)
    ref_caches = tiny_model.allocate_caches(10, 16, 8, num_draft_blocks=10, draft_block_size=16)
    caches = tiny_model.allocate_caches(10, 16, 8, num_draft_blocks=10, draft_block_size=16)
    for layer in ref_caches.draft_kv:
        for a, b in zip(ref_caches.draft_kv[layer], caches.draft_kv[layer]):
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(a)
    chunks = (SeqChunk(20, 1, torch.tensor([3, 1]), 0), SeqChunk(33, 1, torch.tensor([0, 5, 2]), 0),
              SeqChunk(7, 1, torch.tensor([4]), 0))
    batch = ForwardBatch(torch.tensor([5, 6, 7]), chunks)
    prev = torch.randn(3, tiny_model.config.hidden_size, generator=g)
    want = tiny_model.mtp.forward(prev, batch, ref_caches)
    graphs = DecodeGraphs(tiny_model.mtp, caches, EagerReplay(), (1, 2, 4), (16, 32, 64), 9, 7, draft=True)
    assert graphs.buckets(batch) == (1, 4, 64)
    got = graphs.run(batch, prev)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in ref_caches.draft_kv:
        for a, b in zip(ref_caches.draft_kv[layer], caches.draft_kv[layer]):
            torch.testing.assert_close(a[:9], b[:9], atol=1e-6, rtol=1e-5)  # block 9: the scratch
    with pytest.raises(ValueError, match="prev_hidden"):
        graphs.run(batch)


@pytest.mark.parametrize("k", [0, 3])
def test_engine_with_graphs_equals_eager_and_warm_equals_cold(tiny_model, k):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [make_prompt(100 + 7 * i, 60 + i) for i in range(3)]  # past the 64-token alignment: hits
    eager = make_engine(tiny_model, num_spec_tokens=0).generate(prompts, params)
    engine = make_engine(tiny_model, num_spec_tokens=k, graph_backend=EagerReplay())
    assert engine.cache.full.pool.num_blocks == engine.caches.num_kv_blocks - 1  # the scratch block is nobody's
    cold = engine.generate(prompts, params)
    warm = engine.generate(prompts, params)
    assert engine.decode_graphs.num_replays > 0
    if k:  # verify steps and the draft chain's steps went through graphs too
        assert any(key[0] == k + 1 for key in engine.decode_graphs.graphs)
        assert engine.drafter.graphs.num_replays > 0
    assert [o.token_ids for o in cold] == [o.token_ids for o in eager] == [o.token_ids for o in warm]
    assert all(o.num_cached_tokens > 0 for o in warm)
