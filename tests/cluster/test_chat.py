"""`/v1/chat/completions` on the trained tiny checkpoint over a real uvicorn: the template, streaming
and not, usage, and a multi-turn chat whose second turn hits the prefix cache."""

import json
from pathlib import Path

import httpx
import pytest

from cluster.http.app import create_app
from cluster.http.protocol import ChatMessage
from cluster.text.chat import render_chat
from cluster.text.tokenizer import load_tokenizer
from tests.cluster.test_frontend_http import serve_app

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"
SYSTEM = "You complete Python code. " + "import os\nimport sys\nfrom pathlib import Path\n" * 6


def test_template_is_prefix_stable():
    msgs = [ChatMessage(role="system", content="sys"), ChatMessage(role="user", content="hi")]
    first = render_chat(msgs)
    assert first == "<|system|>\nsys\n<|user|>\nhi\n<|assistant|>\n"
    second = render_chat([*msgs, ChatMessage(role="assistant", content="hello"),
                          ChatMessage(role="user", content=[{"type": "text", "text": "more"}])])
    assert second.startswith(first + "hello\n")


@pytest.fixture(scope="module")
def server():
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine_runner import EngineRunner

    engine = LLMEngine.from_checkpoint(str(TRAINED), EngineConfig(kernels="torch", max_model_len=1024,
                                                                  cache_memory_bytes=64 * 2**20))
    runner = EngineRunner(engine)
    app = create_app(runner, "tiny-trained", api_key="k", tokenizer=load_tokenizer(TRAINED))
    with serve_app(app) as url, httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=60) as c:
        yield c
    runner.shutdown()


def _chat(messages, **kw) -> dict:
    return {"model": "tiny-trained", "messages": messages, "max_tokens": 16, "ignore_eos": True, "temperature": 0, **kw}


@pytest.mark.timeout(120)
def test_chat_streaming_and_not(server):
    body = _chat([{"role": "user", "content": "def fib(n):"}], seed=3)
    out = server.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 16
    assert out["usage"]["prompt_tokens"] == len(render_chat([ChatMessage(role="user", content="def fib(n):")]))
    with server.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" and ch["id"] == chunks[0]["id"] for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert content == choice["message"]["content"]  # greedy: the same reply
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    # without include_usage there is no usage chunk
    with server.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        plain = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" not in ch and ch["choices"] for ch in plain)


@pytest.mark.timeout(120)
def test_second_turn_hits_the_prefix_cache(server):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def main():"}]
    first = server.post("/v1/chat/completions", json=_chat(turn1, max_completion_tokens=24)).json()
    reply = first["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] == 24
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "class A:"}]
    second = server.post("/v1/chat/completions", json=_chat(turn2)).json()
    u1, u2 = first["usage"], second["usage"]
    assert u2["prompt_tokens"] > u1["prompt_tokens"] + u1["completion_tokens"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= u1["prompt_tokens"] + u1["completion_tokens"]
    metrics = server.get("/metrics").text
    assert "hybridserve_inter_token_latency_seconds_count" in metrics
    assert "hybridserve_prefix_cache_hits_total 0.0" not in metrics


def test_chat_needs_a_tokenizer_and_the_key(server):
    assert server.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "x"}]),
                       headers={"Authorization": "Bearer nope"}).status_code == 401
    with serve_app(create_app(_NoBackend(), "ids-only")) as url:
        body = {**_chat([{"role": "user", "content": "x"}]), "model": None}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]


class _NoBackend:
    num_unfinished = 0
    max_model_len = None

    def abort(self, request_id: str) -> None:
        pass

    def attach_metrics(self, metrics) -> None:
        pass

    def submit(self, *args):
        raise AssertionError("never reached")
