"""`from hybridserve import LLM, SamplingParams` on the shipped tiny checkpoint (byte tokenizer):
text and token-id prompts, batches, stop strings, logprobs, clear errors; TP=2 through Ray actors
gives the TP=1 greedy tokens."""

import os
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"
KW = dict(kernels="torch", max_model_len=512, cache_memory_bytes=64 * 2**20)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CODE = "import os\nimport sys\nfrom pathlib import Path\n\n\ndef main():\n" * 3


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TRAINED), **KW)


def test_text_and_token_prompts_batch_and_cache(llm):
    outs = llm.generate([CODE, {"prompt_token_ids": llm.tokenizer.encode(CODE)}, "x"], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16, 16]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)
    again = llm.generate(CODE, GREEDY)[0]
    # 180 byte tokens, full:16 + mamba:64 (A = 64), lossless MTP (no drop): floor(179 / 64) * 64 = 128
    assert again.num_cached_tokens == 128 and again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert len(again.prompt_token_ids) == 180 and again.num_computed_prompt_tokens == 180 - 128


def test_stop_strings_logprobs_and_penalties(llm):
    base = llm.generate(CODE, GREEDY)[0].outputs[0]
    stop = base.text[3:6]
    cut = llm.generate(CODE, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop))[0].outputs[0]
    assert cut.text == base.text[: base.text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 16
    scored = llm.generate(CODE, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))[0]
    lps = scored.outputs[0].logprobs
    assert len(lps) == 16 and all(max(d.values()) == d[t] for d, t in zip(lps, scored.outputs[0].token_ids))
    assert scored.outputs[0].cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(lps, base.token_ids)))
    penalised = llm.generate(CODE, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  repetition_penalty=1.8))[0].outputs[0]
    assert penalised.token_ids != base.token_ids  # the penalty reaches the engine's sampler


def test_errors_are_clear(llm, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="only n=1"):
        SamplingParams(n=2)
    with pytest.raises(ValueError, match="max_model_len 512"):
        llm.generate("hi", SamplingParams(max_tokens=600))


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_tp2_through_ray_matches_tp1(llm, tmp_path_factory):
    import ray

    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    try:
        tp2 = LLM(str(TRAINED), tensor_parallel_size=2, **KW)
        try:
            assert getattr(tp2.engine.model, "tp_workers", None)  # rank 1 is a Ray actor
            got = tp2.generate(CODE, GREEDY)[0].outputs[0].token_ids
        finally:
            tp2.close()
    finally:
        ray.shutdown()
    assert got == llm.generate(CODE, GREEDY)[0].outputs[0].token_ids


def test_logprobs_with_speculation_equal_without(llm):
    assert llm.engine.speculative  # the shipped checkpoint has an MTP head: verified drafts carry logprobs
    plain = LLM(str(TRAINED), num_speculative_tokens=0, **KW)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    a, b = llm.generate(CODE, params)[0].outputs[0], plain.generate(CODE, params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == list(y) and all(x[k] == pytest.approx(y[k], abs=1e-4) for k in x)
