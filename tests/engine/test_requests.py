"""Bad input is a clear InvalidRequestError, never a crash; sampling is seeded and reproducible."""

import pytest

from tests.conftest import make_engine, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError, InvalidRequestError
from workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model, num_spec_tokens=0, max_model_len=512)


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ([1, 2, 512], "out of the vocabulary"), ([1, -1], "out of the vocabulary"),
     ([1, "2"], "integers"), (list(range(512)), "max_model_len")],
)
def test_bad_prompts(engine, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(prompt)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kw", [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
           {"top_k": -2}, {"seed": "x"}, {"stop_token_ids": (-1,)}],
)
def test_bad_sampling_params(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [{"kv_block_size": 0}, {"num_spec_tokens": -1}, {"eagle_mode": "maybe"},
                                {"kernels": "gpu"}, {"mamba_memory_fraction": 1.5}])
def test_bad_engine_config(kw):
    with pytest.raises(EngineConfigError):
        EngineConfig(**kw)


def test_max_tokens_is_capped_by_max_model_len(engine):
    (out,) = engine.generate([make_prompt(500, 1)], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_stop_tokens_and_seeded_sampling(engine):
    prompt = make_prompt(40, 2)
    (greedy,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stop = greedy.token_ids[3]
    (stopped,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,),
                                                          ignore_eos=True))
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine.generate([prompt], sampled)[0], engine.generate([prompt], sampled)[0]
    assert a.token_ids == b.token_ids and a.token_ids != greedy.token_ids[:12]


def test_batched_requests_equal_single_runs(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=3, max_num_seqs=4, chunk_size=64)
    prompts = [make_prompt(n, 60 + n) for n in (10, 100, 333, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [make_engine(tiny_model, num_spec_tokens=3).generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    engine.cache.check_integrity()


def test_pool_pressure_evicts_and_stays_exact(tiny_model):
    # a small cache (224 KV blocks for 6 x 44 published: lazy allocation needs only what it writes):
    # later prompts evict earlier ones; nothing breaks, outputs stay exact
    from cache_service.events import BlockRemoved, EventSink

    sink = EventSink("r0")
    engine = make_engine(tiny_model, num_spec_tokens=3, cache_memory_bytes=14 * 2**20, max_model_len=1024, events=sink)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [make_prompt(700, 80 + i) for i in range(6)]
    first = [engine.generate([p], params)[0] for p in prompts]
    again = [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    events = sink.drain()
    assert any(isinstance(e, BlockRemoved) for e in events)  # the pools really evicted
    assert [e.seq for e in events] == list(range(len(events)))
    engine.cache.check_integrity()


def test_generate_cli(tiny_dir, capsys):
    import json

    from workers.generate import main

    ids = ",".join(str(t) for t in make_prompt(200, 9))
    assert main(["--model", tiny_dir, "--token-ids", ids, "--max-tokens", "5", "--repeat", "2",
                 "--kernels", "torch"]) == 0
    cold, warm = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert cold["hit_tokens"] == 0 and warm["hit_tokens"] == 192 and warm["token_ids"] == cold["token_ids"]
    assert main(["--model", tiny_dir, "--token-ids", "1,2,x"]) == 2
    assert main(["--model", tiny_dir, "--token-ids", "", "--kernels", "torch"]) == 2
    assert main(["--model", "/nonexistent", "--token-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3


def test_abort_frees_everything_and_others_continue(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=3, chunk_size=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a = engine.add_request(make_prompt(300, 1), params)
    b = engine.add_request(make_prompt(50, 2), params)
    engine.step()
    assert engine.abort(a) and not engine.abort(a) and not engine.abort("nope")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[b].finished and len(outs[b].token_ids) == 10 and a not in outs
    assert not engine.requests
    full, mamba = engine.cache.pools[0], engine.cache.pools[1]
    assert full.num_free_blocks == full.num_blocks - 1 and mamba.num_free_blocks == mamba.num_blocks - 1
    engine.cache.check_integrity()
