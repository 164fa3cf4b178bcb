"""OpenAI fields -> engine SamplingParams: generation_config defaults fill what a request leaves
out, explicit values win, EOS ids join the stop ids unless ignore_eos, and unsupported values
name their field."""

import pytest

from cluster.http.openai_format import sampling_params
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_generation_config_defaults_fill_omitted_fields():
    p = sampling_params(CompletionRequest(prompt=[5]), 16, None, DEFAULTS, (2, 7))
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert p.stop_token_ids == (2, 7)
    body = CompletionRequest(prompt=[5], temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                             stop_token_ids=[9], ignore_eos=True)
    p = sampling_params(body, 16, 2, DEFAULTS, (2, 7))
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.logprobs) == (0.0, 1.0, 0, 1.0, 2)
    assert p.stop_token_ids == (9,) and p.ignore_eos
    plain = sampling_params(CompletionRequest(prompt=[5]), 16, None, {}, ())  # OpenAI's and vLLM's defaults
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"min_p": 0.1}, "min_p")])
def test_unsupported_completion_fields(fields, param):
    assert CompletionRequest(prompt=[5], **fields).unsupported()[0] == param


def test_defaults_are_supported_and_chat_fields_named():
    defaults = dict(n=1, best_of=1, suffix=None, logit_bias={}, echo=False, logprobs=None, min_p=0.0,
                    response_format={"type": "text"}, presence_penalty=0.0, frequency_penalty=0.0, priority=0)
    assert CompletionRequest(prompt=[5], **defaults).unsupported() is None
    msgs = [{"role": "user", "content": "x"}]
    ok = ChatCompletionRequest(messages=msgs, tools=[], tool_choice="none", parallel_tool_calls=True, logprobs=False,
                               top_logprobs=0, modalities=["text"], store=False, service_tier="auto", metadata={})
    assert ok.unsupported() is None
    for fields, param in [({"tool_choice": "required"}, "tool_choice"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"audio": {}}, "audio"), ({"echo": True}, "echo")]:
        assert ChatCompletionRequest(messages=msgs, **fields).unsupported()[0] == param
    tool_msg = [{"role": "tool", "content": "r", "tool_call_id": "1"}]
    assert ChatCompletionRequest(messages=tool_msg).unsupported()[0] == "messages.0.role"
    assert ChatCompletionRequest(messages=[{"role": "user"}]).unsupported()[0] == "messages.0.content"
    assert ChatCompletionRequest(messages=[*msgs, {"role": "assistant", "content": None}]).unsupported() is None
