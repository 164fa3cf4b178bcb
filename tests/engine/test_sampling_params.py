"""One `SamplingParams` type: the user's (`hybridserve`), the HTTP front end's, the one
`GenerateMsg` carries and the engine's sampler are the same class with vLLM's defaults."""

import pytest

import hybridserve
from cluster.http.openai_format import sampling_params
from cluster.http.protocol import CompletionRequest
from tests.conftest import make_engine, make_prompt
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.replica_messages import GenerateMsg


def test_one_type_from_the_user_to_the_engine():
    assert hybridserve.SamplingParams is SamplingParams
    assert GenerateMsg.__dataclass_fields__["params"].type in ("SamplingParams", SamplingParams)
    body = CompletionRequest(model="m", prompt="hi", stop="\n", stop_token_ids=[5], max_tokens=3)
    built = sampling_params(body, 3, None, {}, eos_token_ids=(2, 5))
    assert type(built) is SamplingParams
    assert built.stop == ("\n",) and built.stop_token_ids == (5, 2)  # EOS added once, after the user's ids


def test_vllm_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.top_k, p.n, p.skip_special_tokens) == (1.0, 16, 0, 1, True)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(max_tokens=None, min_tokens=40).max_tokens is None
    with pytest.raises(InvalidRequestError, match="only n=1"):
        SamplingParams(n=2)
    with pytest.raises(InvalidRequestError, match="stop must be"):
        SamplingParams(stop=[3])


def test_stopping_at_adds_eos_unless_ignored():
    p = SamplingParams(stop_token_ids=(7,))
    assert p.stopping_at((2, 7, 2)).stop_token_ids == (7, 2)
    assert SamplingParams(ignore_eos=True, stop_token_ids=(7,)).stopping_at((2,)).stop_token_ids == (7,)


def test_engine_resolves_max_tokens_none_to_the_rest_of_the_context(tiny_model):
    engine = make_engine(tiny_model, max_model_len=64)
    (out,) = engine.generate([make_prompt(50, 1)], SamplingParams(temperature=0.0, max_tokens=None,
                                                                   ignore_eos=True, min_tokens=30))
    assert len(out.token_ids) == 14 and out.finish_reason == "length"  # min_tokens capped at what fits
