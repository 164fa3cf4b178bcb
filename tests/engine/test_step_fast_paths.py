"""The engine's per-request fast paths change nothing: the step's batched argmax picks the token
`Sampler.sample` would (first maximum on ties), only for requests whose token is the raw argmax; a
mixed batch equals solo runs; kept block tables and growth covers follow growth, preemption and
release (checked by `EngineCacheManager.check_integrity` after every step)."""

import random

import pytest
import torch

from bench.host_counters import HostCounter
from tests.conftest import make_engine, make_prompt
from workers.engine.request import Request
from workers.engine.sampling import Sampler, token_logprobs
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ChunkKind, ScheduledChunk
from workers.engine.step_inputs import StepLogits


def tied_rows(rng: random.Random, num_rows: int, vocab: int) -> torch.Tensor:
    """Rows of small integers: most rows have several maxima, some at the first or last index."""
    rows = torch.tensor([[float(rng.randrange(4)) for _ in range(vocab)] for _ in range(num_rows)])
    rows[0] = 1.0  # every entry a maximum
    rows[1, -1] = 9.0  # the only maximum is the last entry
    rows[2, [3, 7]] = float("inf")
    rows[3] = float("-inf")
    rows[3, [5, 6]] = -1.0
    rows[4, [2, 9]] = float("nan")  # NaN counts as the maximum in both forms
    return rows


def test_step_argmax_equals_the_per_row_sampler_including_ties():
    rng = random.Random(0)
    rows = tied_rows(rng, 40, 16)
    assert sum(int((r == r.max()).sum()) > 1 for r in rows) >= 20  # ties are the common case here
    spans = [(0, 1), None, (1, 5), (5, 40), None]
    logits = StepLogits(rows, spans)
    with pytest.raises(AssertionError, match="read_back"):
        _ = logits.argmax
    logits.read_back()
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert logits.argmax == [greedy.sample(r) for r in rows] == [int(torch.argmax(r)) for r in rows]
    assert logits.argmax[:5] == [0, 15, 3, 5, 2]
    for i, span in enumerate(spans):
        if span is None:
            with pytest.raises(AssertionError):
                logits.argmax_of(i)
            continue
        assert logits.argmax_of(i) == [greedy.sample(r) for r in rows[span[0] : span[1]]]
        torch.testing.assert_close(logits.of(i), rows[span[0] : span[1]], rtol=0, atol=0, equal_nan=True)
    empty = StepLogits(None, [None, None])
    empty.read_back()
    assert empty.argmax == []


def test_step_samples_equal_the_per_request_sampler_and_token_logprobs():
    """Sampled tokens and logprobs computed for the whole step on the device, read in one copy, equal
    what each request's Sampler.sample and token_logprobs give row by row."""
    rows = torch.randint(0, 4, (9, 16), generator=torch.Generator().manual_seed(0)).float()  # ties everywhere
    greedy = dict(temperature=0.0)
    specs = [(SamplingParams(**greedy, logprobs=2), (0, 4)),
             (SamplingParams(temperature=0.9, seed=3, logprobs=0), (4, 5)),
             (SamplingParams(**greedy, repetition_penalty=1.7, logprobs=5), (5, 6)),
             (SamplingParams(**greedy), (6, 7)),
             (SamplingParams(temperature=1.3, top_k=4, seed=9), (7, 8)),
             (SamplingParams(**greedy, logprobs=2), (8, 9))]
    scheduled = []
    for n, (params, _) in enumerate(specs):
        req = Request(f"r{n}", [1, 2, 3], params, hashes=None, sampler=Sampler(params))
        req.output_token_ids = [5, 5, 7]
        scheduled.append(ScheduledChunk(req, ChunkKind.DECODE, 1))
    logits = StepLogits(rows, [span for _, span in specs])
    with HostCounter() as counter:
        logits.read_back(None, scheduled)
    assert counter.counts().num_syncs == 1
    for n, (params, (a, b)) in enumerate(specs):
        ref = Sampler(params)
        if ref.is_argmax:
            tokens = logits.argmax_of(n)
            assert n not in logits.samples.tokens_of
        else:
            tokens = [logits.samples.tokens_of[n]]
            assert tokens == [ref.sample(rows[a], [1, 2, 3], [5, 5, 7])]
        if params.logprobs is None:
            assert n not in logits.samples.logprobs_of
            continue
        want = [token_logprobs(rows[r], t, params.logprobs) for r, t in zip(range(a, b), tokens)]
        assert logits.samples.logprobs_of[n] == want


@pytest.mark.parametrize("kw", [{"temperature": 0.7, "seed": 1}, {"repetition_penalty": 1.5},
                                {"presence_penalty": 1.0}, {"frequency_penalty": 1.0},
                                {"min_tokens": 2, "max_tokens": 4}])
def test_only_unshaped_greedy_requests_take_the_batched_argmax(kw):
    """A request whose token can differ from the raw argmax never takes it."""
    assert Sampler(SamplingParams(temperature=0.0)).is_argmax
    assert Sampler(SamplingParams(temperature=0.0, logprobs=3, stop_token_ids=(2,))).is_argmax
    sampler = Sampler(SamplingParams(**kw), eos_token_ids=(0,))
    assert not sampler.is_argmax
    # and the difference is real: some row's sampled token is not its argmax
    rng = random.Random(1)
    rows = [torch.tensor([rng.uniform(-1, 1) for _ in range(8)]) for _ in range(50)]
    for row in rows:
        row[0] = row.max() + 0.1  # the favourite is eos and the repeated token
    assert any(sampler.sample(row, [0, 0], [0]) != int(torch.argmax(row)) for row in rows)


@pytest.mark.parametrize("k", [0, 3])
def test_a_mixed_batch_equals_solo_runs(tiny_model, k):
    """Greedy, penalized, seeded-sampled, logprobs and stop-token requests in one batch: every
    output (tokens and logprobs) equals the request's solo run."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=5),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=0.5, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=3)]
    prompts = [make_prompt(20 + 9 * i, 40 + i) for i in range(len(params))]
    solo_engine = make_engine(tiny_model, num_spec_tokens=k, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    stop = solo[0].token_ids[4]  # a stop id the first request meets mid-way
    params.append(SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop,)))
    prompts.append(prompts[0])
    solo.append(solo_engine.generate([prompts[-1]], params[-1])[0])
    assert solo[-1].finish_reason == "stop" and solo[-1].token_ids[-1] == stop
    engine = make_engine(tiny_model, num_spec_tokens=k)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, syncs = {}, []
    while engine.has_unfinished():
        with HostCounter() as counter:  # sampled tokens, penalties and logprobs included: one read per step
            outputs = engine.step()
        syncs.append((counter.counts().num_syncs, counter.counts().sync_sites))
        done.update({o.request_id: o for o in outputs if o.finished})
        engine.cache.check_integrity()
    assert max(n for n, _ in syncs) == 1, syncs
    for rid, want in zip(ids, solo):
        got = done[rid]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        # the same alternatives; values up to float rounding (a batched GEMM sums in another order)
        got_top = [[t for t, _ in lp.top] for lp in got.logprobs or ()]
        assert got_top == [[t for t, _ in lp.top] for lp in want.logprobs or ()]
        assert [lp.logprob for lp in got.logprobs or ()] == pytest.approx(
            [lp.logprob for lp in want.logprobs or ()], abs=1e-4)
        assert (got.logprobs is None) == (want.logprobs is None) == (params[ids.index(rid)].logprobs is None)
    assert done[ids[1]].token_ids != done[ids[0]].token_ids  # the penalty changed the greedy output


def sized_engine(model, num_blocks: int, num_pages: int, k: int, **kw):
    kv = model.kv_bytes_per_block(16) + (model.draft_kv_bytes_per_block(16) if k else 0)
    kv_bytes, page_bytes = num_blocks * kv, num_pages * model.state_bytes_per_slot()
    return make_engine(model, num_spec_tokens=k, cache_memory_bytes=kv_bytes + page_bytes,
                       mamba_memory_fraction=page_bytes / (kv_bytes + page_bytes) + 1e-9, **kw)


@pytest.mark.parametrize("k", [0, 3])
def test_kept_block_tables_and_covers_follow_growth_preemption_and_release(tiny_model, k):
    rng = random.Random(k)
    prompts = [make_prompt(rng.randrange(20, 60), 700 + i) for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    solo_engine = make_engine(tiny_model, num_spec_tokens=0, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    engine = sized_engine(tiny_model, 28 if k == 0 else 20, 16, k, max_model_len=256, max_num_seqs=10)
    cache = engine.cache
    ids = [engine.add_request(p, params) for p in prompts]
    done, last, num_reused, num_rebuilt = {}, {}, 0, 0
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        cache.check_integrity()  # kept tables equal the block ids; covers within the pages held
        for req in engine.scheduler.running:
            table = cache.block_table(req)
            assert table.tolist() == cache.full.block_ids(req.request_id)
            if k:
                assert cache.draft_table(req).tolist() == cache.draft.block_ids(req.request_id)
            before = last.get(req.request_id)
            num_reused += table is before
            num_rebuilt += before is not None and table is not before
            last[req.request_id] = table
    assert [done[i].token_ids for i in ids] == solo
    assert engine.stats()["num_preemptions"] > 0
    assert num_reused > 2 * num_rebuilt > 0  # kept across steps, rebuilt when the blocks changed
    assert len(cache.block_tables) == 0 and not cache._covered
    assert k == 0 or len(cache.draft_tables) == 0


def test_the_model_eos_stops_a_request_unless_it_ignores_eos(tiny_model):
    """Stop ids come from the request's sampler: its stop_token_ids plus the model's EOS ids,
    which `ignore_eos` leaves out."""
    engine = make_engine(tiny_model, num_spec_tokens=0)
    prompt = make_prompt(30, 9)
    (free,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    eos = free.token_ids[5]
    first = free.token_ids.index(eos)
    engine.eos_token_ids = (eos,)  # as if config.json named it
    (heeds,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    (ignores,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert (heeds.token_ids, heeds.finish_reason) == (free.token_ids[: first + 1], "stop")
    assert (ignores.token_ids, ignores.finish_reason) == (free.token_ids, "length")
    assert Sampler(SamplingParams(temperature=0.0, stop_token_ids=(7,)), eos_token_ids=(2, 3)).stop_token_ids == {2,
                                                                                                                  3, 7}


@pytest.mark.parametrize("k, eagle, kept", [(3, "lossless", True), (3, "drop", False), (0, "lossless", False)])
def test_the_hidden_state_sidecar_is_kept_only_for_lossless_drafting(tiny_model, k, eagle, kept):
    """Only lossless EAGLE reads the sidecar (a hit's draft KV at L-1); any other engine must not pay a
    copy per completed block for it, and the lossless one must keep every completed block's row."""
    engine = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle)
    engine.generate([make_prompt(70, seed=3)], SamplingParams(temperature=0.0, max_tokens=2))
    written = int((engine.cache.sidecar.abs().sum(dim=1) > 0).sum())
    assert written == (70 // engine.cache.block_size if kept else 0)
