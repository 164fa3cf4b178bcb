"""Lazy allocation with preemption by recompute, and the token-budget scheduler.

64 requests whose up-front reservations (prompt + max_tokens + k KV blocks, 3 + (k+1) Mamba
pages each, what admission took before) would be 3x the pools all complete, are preempted along
the way, and every output equals the request's solo run token for token.
"""

import random

import pytest

from cluster.http.metrics import Metrics
from tests.conftest import make_engine, make_prompt
from workers.engine.engine import LLMEngine
from workers.engine.request import RequestOutput
from workers.engine.sampling_params import SamplingParams


def run_all(engine: LLMEngine, prompts, params) -> tuple[dict[str, RequestOutput], list[str]]:
    """Submit everything at once and step; outputs by id, and the order of first tokens."""
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    first: list[str] = []
    while engine.has_unfinished():
        outs = engine.step()
        assert outs or engine.scheduler.running, "the engine stalled"
        for out in outs:
            if out.token_ids and out.request_id not in first:
                first.append(out.request_id)
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_integrity()
    return {i: done[i] for i in ids} | done, first


def sized_engine(model, num_blocks: int, num_pages: int, k: int, **kw) -> LLMEngine:
    """An engine whose pools hold about `num_blocks` KV blocks and `num_pages` Mamba pages."""
    kv = model.kv_bytes_per_block(16) + (model.draft_kv_bytes_per_block(16) if k else 0)
    kv_bytes, page_bytes = num_blocks * kv, num_pages * model.state_bytes_per_slot()
    return make_engine(model, num_spec_tokens=k, cache_memory_bytes=kv_bytes + page_bytes,
                       mamba_memory_fraction=page_bytes / (kv_bytes + page_bytes) + 1e-9, **kw)


def upfront_reservation(engine: LLMEngine, prompts, params) -> tuple[int, int]:
    """(KV blocks, Mamba pages) the old admission reserved for all of `prompts` together."""
    k = engine.cache.num_spec_tokens
    blocks = sum(-(-(len(p) + params.max_tokens + k) // engine.cache.block_size) for p in prompts)
    pages = len(prompts) * (3 + (k + 1 if k else 0))
    return blocks, pages


@pytest.mark.heavy
@pytest.mark.parametrize("k, num_requests", [(0, 64), (3, 16)])
def test_oversubscribed_requests_all_complete_exactly_with_preemptions(tiny_model, k, num_requests):
    rng = random.Random(k)
    prompts = [make_prompt(rng.randrange(24, 100), 500 + i) for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    solo_engine = make_engine(tiny_model, num_spec_tokens=0, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    blocks, pages = (110, 40) if k == 0 else (31, 20)
    engine = sized_engine(tiny_model, blocks, pages, k, eagle_mode="lossless", max_model_len=256,
                          max_num_seqs=num_requests)
    full, mamba = engine.cache.full.pool, engine.cache.mamba.pool
    want_blocks, want_pages = upfront_reservation(engine, prompts, params)
    assert want_blocks >= 3 * full.num_blocks and want_pages >= 3 * mamba.num_blocks
    outs, _ = run_all(engine, prompts, params)
    assert [o.token_ids for o in outs.values()] == solo
    preempted = sum(o.num_preemptions for o in outs.values())
    assert preempted == engine.stats()["num_preemptions"] > 0
    assert sum(1 for o in outs.values() if o.num_preemptions) >= 2  # not one request thrashing
    assert not engine.requests and full.num_free_blocks == full.num_blocks - 1
    assert mamba.num_free_blocks == mamba.num_blocks - 1
    metrics = Metrics()  # the /metrics counter, vLLM's name
    for out in outs.values():
        metrics.record(out)
    assert metrics.registry.get_sample_value("vllm:num_preemptions_total") == preempted


def test_preempted_request_resumes_with_a_hit(tiny_model):
    """A request preempted mid-decode resumes from its published prefix (a hit), not from 0."""
    engine = make_engine(tiny_model, num_spec_tokens=0, chunk_size=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (solo,) = make_engine(tiny_model, num_spec_tokens=0).generate([make_prompt(200, 7)], params)
    rid = engine.add_request(make_prompt(200, 7), params)
    while not engine.requests[rid].output_token_ids:
        engine.step()
    for _ in range(5):
        engine.step()
    req = engine.requests[rid]
    engine.scheduler.preempt(req)
    assert req.num_computed_tokens == 0 and not engine.cache.holds(req)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[rid].token_ids == solo.token_ids and outs[rid].num_preemptions == 1
    assert req.num_restored_tokens >= 192  # the prompt's replay boundary at least: not a cold restart


def test_short_request_behind_a_long_one_that_does_not_fit_gets_its_first_token_first(tiny_model):
    engine = sized_engine(tiny_model, 80, 10, 0, max_model_len=1100)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    hog = engine.add_request(make_prompt(800, 1), params)
    while engine.requests[hog].is_prefilling:
        engine.step()
    long = engine.add_request(make_prompt(1000, 2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    short = engine.add_request(make_prompt(20, 3), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    # the long request's first chunk (512 tokens = 32 blocks) does not fit beside the hog
    assert engine.cache.full.pool.num_free_blocks < 32
    first_token: dict[str, int] = {}
    finished: dict[str, int] = {}
    outs = {}
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.token_ids:
                first_token.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
                outs[out.request_id] = out
    # the short one ran while the hog still held the memory the long one waits for (head-of-line
    # blocking would hold it back until the hog finished and the long one was admitted)
    assert first_token[short] < finished[hog] < first_token[long]
    solo = make_engine(tiny_model, num_spec_tokens=0, max_model_len=1100)
    (expect,) = solo.generate([make_prompt(1000, 2)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert outs[long].token_ids == expect.token_ids and len(outs[hog].token_ids) == 24


def test_token_budget_mixes_decodes_first_and_cuts_chunks_at_alignment(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=0, chunk_size=512, max_num_batched_tokens=200)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = engine.add_request(make_prompt(100, 1), params)
    while engine.requests[a].is_prefilling:  # chunks [0, 64) (a checkpoint), [64, 100)
        engine.step()
    b = engine.add_request(make_prompt(700, 2), params)
    sched = engine.scheduler.schedule()
    kinds = [(s.req.request_id, s.kind.value, s.num_new_tokens) for s in sched]
    # a decodes first (1 token); b's chunk is cut at the largest multiple of A=64 within 199 tokens
    assert kinds == [(a, "decode", 1), (b, "prefill", 192)]
    assert sum(n for _, _, n in kinds) <= 200
