"""The official `openai` SDK against the served Ray cluster (`cluster.backend: ray`: a replica
actor and the cache service behind the front end), HF-format checkpoint: the new sampling fields
(logprobs, penalties, min_tokens) cross the actor boundary, stop strings end requests there,
and a resend reports cached tokens."""

import os

import openai
import pytest

from cluster.config_loader import load_config
from cluster.http.local_server import serve_app
from cluster.serve import build_app
from tests.cluster.hf_checkpoint import make_hf_checkpoint

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]
SYSTEM = "You are a helpful assistant. Answer the user's question about Python code briefly. " * 6


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    hf_dir = make_hf_checkpoint(tmp_path_factory.mktemp("sdk-ray") / "tiny-hf")
    config = load_config(None, settings={
        "cluster.backend": "ray", "cluster.num_cpus": 2, "cluster.num_replicas": 1, "model.path": str(hf_dir),
        "engine.kernels": "torch", "engine.max_model_len": 512, "engine.cache_memory_bytes": 64 * 2**20})
    server = build_app(config)
    try:
        with serve_app(server.app) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        server.close()


def test_sdk_through_the_ray_cluster(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def main():"}]
    kw = dict(model="tiny-hf", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = first.choices[0].logprobs.content
    assert len(content) == 12 and content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    details = again.usage.prompt_tokens_details  # OpenAI's shape; the SDK keeps the extension field
    assert details.cached_tokens >= 64 and details.computed_tokens == again.usage.prompt_tokens - details.cached_tokens
    text = first.choices[0].message.content
    stop = text[4:7]
    cut = client.chat.completions.create(**kw, stop=stop)
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    penalised = client.chat.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != text
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 12
