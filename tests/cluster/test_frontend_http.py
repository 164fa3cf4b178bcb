"""The OpenAI-compatible front end, for real: uvicorn on 127.0.0.1, httpx as the client."""

import json
import socket

import httpx
import pytest

from cluster.http.app import create_app
from cluster.http.local_server import serve_app  # noqa: F401 - re-exported for other tests
from tests.conftest import make_engine, make_prompt
from workers.engine_runner import EngineRunner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model):
    runner = EngineRunner(make_engine(tiny_model, num_spec_tokens=3, eagle_mode="lossless"))
    with serve_app(create_app(runner, "tiny", api_key="sekret")) as url:
        yield url
    runner.shutdown()


AUTH = {"Authorization": "Bearer sekret"}


@pytest.mark.timeout(120)
def test_resend_hits_and_equals_cold_over_http(server, tiny_model):
    prompt = make_prompt(600, 77)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        before = tiny_model.forward_counts.num_prompt_tokens
        cold = c.post("/v1/completions", json=body).json()
        warm = c.post("/v1/completions", json=body).json()
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "computed_tokens": 600}
        # 576 = floor(599 / 64) * 64 (lossless: no drop); the model runs only the other 24
        assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 576, "computed_tokens": 24}
        assert tiny_model.forward_counts.num_prompt_tokens - before == 600 + 24
        assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        assert warm["usage"]["completion_tokens"] == 8
        # streaming: SSE chunks whose tokens concatenate to the same output
        tokens, usage = [], None
        with c.stream("POST", "/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            tokens += chunk["choices"][0]["token_ids"] if chunk["choices"] else []
            usage = chunk.get("usage", usage)
        assert tokens == cold["choices"][0]["token_ids"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 576, "computed_tokens": 24}
        metrics = c.get("/metrics").text
        assert "hybridserve_prefix_cache_hit_tokens_total 1152.0" in metrics
        assert 'hybridserve_prompt_tokens_by_source_total{source="local_compute"} 648.0' in metrics  # 600 + 24 + 24
        assert 'hybridserve_prompt_tokens_by_source_total{source="local_cache_hit"} 1152.0' in metrics
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert c.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, status",
    [
        ({"prompt": []}, 400),
        ({"prompt": [1, 2, 9999]}, 400),
        ({"prompt": "text"}, 400),
        ({"prompt": [1, 2], "max_tokens": -1}, 400),
        ({"prompt": [1, 2], "max_tokens": "many"}, 400),
        ({"prompt": [1, 2], "temperature": -2}, 400),
        ({"prompt": [1, 2], "unknown_field": 1}, 400),
        ({"prompt": [1, 2], "model": "other"}, 404),
        ({}, 400),
    ],
)
def test_bad_input_is_a_4xx_json_error(server, body, status):
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == status
    assert "message" in r.json()["error"]


def test_malformed_json_and_auth(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        r = c.post("/v1/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        assert c.post("/v1/completions", json={"prompt": [1]}).status_code == 401
        wrong = {"Authorization": "Bearer no"}
        assert c.post("/v1/completions", json={"prompt": [1]}, headers=wrong).status_code == 401
        assert c.get("/health").status_code == 200  # health needs no key
