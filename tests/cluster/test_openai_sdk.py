"""The official `openai` SDK against `hybridserve serve`'s app (built by `cluster.serve.build_app`
from a Hugging Face-format checkpoint: BPE tokenizer.json, ChatML template, generation_config)
over a real uvicorn: completions and chat, streaming with usage, logprobs, multi-character stop
strings, explicit default parameters, cached_tokens on a resend, and clear 400s naming the field."""

from pathlib import Path

import httpx
import openai
import pytest

from cluster.config_loader import load_config
from cluster.http.local_server import serve_app
from cluster.serve import build_app
from tests.cluster.hf_checkpoint import make_hf_checkpoint

MAX_MODEL_LEN = 512
SYSTEM = "You are a helpful assistant. Answer the user's question about Python code briefly. " * 6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("sdk") / "tiny-hf")


@pytest.fixture(scope="module")
def served(hf_dir):
    config = load_config(None, settings={
        "cluster.backend": "inprocess", "model.path": str(hf_dir), "model.served_model_name": "tiny-hf",
        "http.api_key": "sk-test", "engine.kernels": "torch", "engine.max_model_len": MAX_MODEL_LEN,
        "engine.cache_memory_bytes": 64 * 2**20})
    server = build_app(config)
    try:
        with serve_app(server.app) as url:
            yield url
    finally:
        server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="sk-test", max_retries=0, timeout=120)


def _chat(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def test_completions_with_explicit_defaults_and_logprobs(client):
    base = dict(model="tiny-hf", prompt="def fibonacci(n):", max_tokens=12, extra_body={"ignore_eos": True})
    sampled = client.completions.create(**base, seed=7)  # omitted temperature: OpenAI's 1.0
    explicit = client.completions.create(**base, n=1, best_of=1, echo=False, logprobs=None, presence_penalty=0,
                                         frequency_penalty=0, logit_bias={}, suffix=None, stop=None, user="u",
                                         stream=False, temperature=1, top_p=1, seed=7)
    assert explicit.choices[0].text == sampled.choices[0].text and sampled.usage.completion_tokens == 12
    base["temperature"] = 0
    plain = client.completions.create(**base)
    assert plain.object == "text_completion" and plain.created > 0 and plain.choices[0].finish_reason == "length"
    scored = client.completions.create(**base, logprobs=3)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == plain.choices[0].text == "".join(lp.tokens)
    assert len(lp.token_logprobs) == 12 and all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(value)  # greedy: the best token
        assert top[token] == pytest.approx(value)
    echoed = client.completions.create(**base, echo=True)
    assert echoed.choices[0].text == "def fibonacci(n):" + plain.choices[0].text


def test_chat_streaming_with_usage_matches_non_streaming(client):
    kw = dict(model="tiny-hf", messages=_chat("def main():"), max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw, n=1, logprobs=False, presence_penalty=0, frequency_penalty=0,
                                          response_format={"type": "text"}, tool_choice="none", store=False,
                                          top_p=1, seed=7)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_usage_only_on_a_final_chunk_without_choices(client, endpoint):
    """OpenAI and vLLM: `include_usage` adds one last chunk with `choices: []` and the usage; no other
    chunk carries usage (unless vLLM's `continuous_usage_stats`, then each does); without it, none."""
    if endpoint == "completions":
        create, kw = client.completions.create, dict(prompt="def fibonacci(n):")
    else:
        create, kw = client.chat.completions.create, dict(messages=_chat("def fibonacci(n):"))
    kw = dict(model="tiny-hf", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, **kw)
    full = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    plain = list(create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    continuous = list(create(**kw, stream=True, stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True}))
    assert continuous[-1].choices == [] and all(c.usage is not None for c in continuous)
    counts = [c.usage.completion_tokens for c in continuous]
    assert counts == sorted(counts) and counts[-1] == 12


def test_omitted_temperature_samples_as_openai_and_vllm_do(client):
    """No `temperature` and no generation_config value: OpenAI's default 1.0 samples (a seed makes it
    reproducible); `temperature: 0` is greedy."""
    kw = dict(model="tiny-hf", prompt="def fibonacci(n):", max_tokens=16, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw, temperature=0).choices[0].model_extra["token_ids"]
    assert client.completions.create(**kw, temperature=0).choices[0].model_extra["token_ids"] == greedy
    sampled = {seed: client.completions.create(**kw, seed=seed).choices[0].model_extra["token_ids"]
               for seed in (1, 2, 3)}
    assert all(client.completions.create(**kw, seed=s).choices[0].model_extra["token_ids"] == ids
               for s, ids in sampled.items())
    assert len({tuple(ids) for ids in sampled.values()}) > 1 and any(ids != greedy for ids in sampled.values())
    chat = dict(model="tiny-hf", messages=_chat("def main():"), max_tokens=16, extra_body={"ignore_eos": True})
    replies = {client.chat.completions.create(**chat, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(replies) > 1


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny-hf", messages=_chat("import os"), max_tokens=8, temperature=0,
                                         logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 8 and "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and bytes(c.bytes).decode() == c.token


def test_multi_character_stop_string(client):
    kw = dict(model="tiny-hf", prompt="class Reader:\n    def read(self, path):\n", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[6:10]
    assert len(stop) == 4 and stop in text
    cut = client.completions.create(**kw, stop=[stop, "never-there"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_resend_reports_cached_tokens_and_second_turn_hits(client):
    turn1 = _chat("def fibonacci(n):")
    first = client.chat.completions.create(model="tiny-hf", messages=turn1, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model="tiny-hf", messages=turn1, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "now in C"}]
    second = client.chat.completions.create(model="tiny-hf", messages=turn2, max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 64 * 64 - 64 > 0


def test_models_and_errors_name_the_field(client, served):
    card = client.models.retrieve("tiny-hf")
    assert card.id == "tiny-hf" and card.created > 0 and [m.id for m in client.models.list()] == ["tiny-hf"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    msgs = _chat("x")
    for kwargs, param in [({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                          ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                          ({"response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny-hf", messages=msgs, max_tokens=2, **kwargs)
        assert exc.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model="tiny-hf", prompt="hello", max_tokens=MAX_MODEL_LEN)
    null_assistant = [*msgs, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]
    assert client.chat.completions.create(model="tiny-hf", messages=null_assistant, max_tokens=2).choices
    with httpx.Client(base_url=served, timeout=30) as c:
        assert c.get("/version").json() == {"version": "0.1.0"}
        ids = c.post("/tokenize", json={"prompt": "hello world"}).json()
        assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
        assert c.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "hello world"}


def test_served_chat_prompt_equals_transformers(served, hf_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(hf_dir))
    msgs = [*_chat("def f():"), {"role": "assistant", "content": "pass"}, {"role": "user", "content": "Héllo ✓"}]
    theirs = reference.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    with httpx.Client(base_url=served, timeout=60, headers={"Authorization": "Bearer sk-test"}) as c:
        assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == theirs
        body = {"messages": msgs, "max_tokens": 1}
        assert c.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == len(theirs)


def test_llm_generate_gives_the_served_greedy_tokens(client, hf_dir):
    from hybridserve import LLM, SamplingParams

    llm = LLM(str(hf_dir), kernels="torch", max_model_len=MAX_MODEL_LEN, cache_memory_bytes=64 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    served = client.completions.create(model="tiny-hf", prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    offline = llm.generate("def fibonacci(n):", params)[0]
    assert offline.outputs[0].token_ids == served.model_extra["token_ids"] and offline.outputs[0].text == served.text
    messages = _chat("def main():")
    chat = client.chat.completions.create(model="tiny-hf", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    first, again = llm.chat(messages, params)[0], llm.chat(messages, params)[0]
    assert first.outputs[0].text == again.outputs[0].text == chat
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 64  # the resend hits the prefix cache
    by_ids = llm.generate({"prompt_token_ids": first.prompt_token_ids}, params)[0]
    assert by_ids.outputs[0].token_ids == first.outputs[0].token_ids


def test_min_tokens_and_stop_token_ids(client):
    kw = dict(model="tiny-hf", prompt="import os\n", max_tokens=8, temperature=0)
    first = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"][0]
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [first]}).choices[0]
    assert stopped.model_extra["token_ids"] == [first] and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == first and stopped.text == ""  # the stop token is not shown
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [first], "min_tokens": 3}).choices[0]
    ids = held.model_extra["token_ids"]
    assert len(ids) >= 3 and first not in ids[:3]
