"""Penalties, min_tokens and logprobs in the sampler, against hand-computed logits (HF/vLLM
semantics: repetition on prompt + output, positive logits divided, negative multiplied;
presence/frequency on output counts only)."""

import math

import pytest
import torch

from workers.engine.errors import InvalidRequestError
from workers.engine.sampling import Sampler, token_logprobs
from workers.engine.sampling_params import SamplingParams


def test_repetition_presence_frequency_exact():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.5])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    shaped = Sampler(p).shape(logits, prompt_ids=[0, 1], output_ids=[3, 3, 2])
    expected = torch.tensor([2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.5, 1.5])
    assert torch.allclose(shaped, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, 1.5]))  # the input is not modified
    # greedy choice follows the shaped logits: 3 wins raw, 4 wins shaped
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == 3
    assert Sampler(p).sample(logits, [0, 1], [3, 3, 2]) == 4


def test_min_tokens_bans_stop_and_eos_until_reached():
    logits = torch.tensor([0.0, 0.0, 9.0, 8.0, 1.0])
    s = Sampler(SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(3,)), eos_token_ids=(2,))
    assert s.sample(logits, [], [4]) == 4  # 2 (EOS) and 3 (stop) banned before 2 outputs
    assert s.sample(logits, [], [4, 4]) == 2
    assert Sampler(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)).sample(logits, [],
                                                                                          []) == 2  # no eos passed


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    lp = token_logprobs(logits, 0, 2)
    z = math.log(sum(math.exp(v) for v in (1.0, 2.0, 3.0)))
    assert lp.logprob == pytest.approx(1.0 - z) and [i for i, _ in lp.top] == [2, 1]
    assert lp.top[0][1] == pytest.approx(3.0 - z) and token_logprobs(logits, 1, 0).top == ()


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                {"min_tokens": 17}, {"logprobs": 21}, {"logprobs": True}])
def test_bad_values_are_invalid_requests(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_extreme_values_stay_finite():
    logits = torch.randn(64)
    s = Sampler(SamplingParams(temperature=99.0, top_p=5e-324, repetition_penalty=5e-324, seed=0))
    assert 0 <= s.sample(logits, [1, 2, 3], []) < 64
    assert 0 <= Sampler(SamplingParams(temperature=1e-30, seed=1)).sample(logits) < 64
