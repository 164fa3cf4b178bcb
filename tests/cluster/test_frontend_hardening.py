"""Hostile and unlucky clients over a real uvicorn on 127.0.0.1: every bad input is a 4xx JSON error
in OpenAI's shape, overload is a 429 with Retry-After, a backend failing mid-stream ends the SSE
stream with an error event, and a client that goes away aborts its request in the engine."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.http.app import create_app
from cluster.text.tokenizer import ByteTokenizer
from tests.cluster.test_frontend_http import serve_app
from tests.conftest import make_engine, make_prompt
from workers.engine.errors import InvalidRequestError, ServerOverloadedError
from workers.engine.request import RequestOutput
from workers.engine_runner import EngineRunner, RequestStream, StreamEnd

AUTH = {"Authorization": "Bearer k"}
JSON = {**AUTH, "content-type": "application/json"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model):
    runner = EngineRunner(make_engine(tiny_model, max_model_len=256, num_spec_tokens=0))
    app = create_app(runner, "tiny", api_key="k", tokenizer=ByteTokenizer(), max_body_bytes=MAX_BODY)
    with serve_app(app) as url:
        yield url
    runner.shutdown()


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    return error


P = [5, 6, 7]
BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": [1, True]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [1, 9999]}, "prompt"), ({"prompt": [-1]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"), ({"prompt": [5] * 300}, "prompt"), ({"prompt": "a" * 256}, "prompt"),
    ({"prompt": P, "max_tokens": -1}, "max_tokens"), ({"prompt": P, "max_tokens": 0}, "max_tokens"),
    ({"prompt": P, "max_tokens": 10**12}, "max_tokens"), ({"prompt": P, "max_tokens": 1000}, "max_tokens"),
    ({"prompt": P, "max_tokens": "16"}, "max_tokens"), ({"prompt": P, "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": P, "temperature": -2}, "temperature"), ({"prompt": P, "temperature": "hot"}, "temperature"),
    ({"prompt": P, "top_p": 0}, "top_p"), ({"prompt": P, "seed": 2**70}, "seed"),
    ({"prompt": P, "stream": "yes"}, "stream"), ({"prompt": P, "stop": ["a"] * 17}, "stop"),
    ({"prompt": P, "stop_token_ids": [-3]}, "stop_token_ids"), ({"prompt": P, "n": 2}, "n"),
    ({"prompt": P, "unknown_field": 1}, "unknown_field"), ({}, "prompt"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_is_a_400(server, body, param):
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as c:
        assert assert_error(c.post("/v1/completions", json=body), 400)["param"] == param


BAD_CHATS = [
    {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": [{"role": "user", "content": "a" * 300}]}, {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, {},
]


@pytest.mark.parametrize("body", BAD_CHATS)
def test_bad_chat_is_a_400(server, body):
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as c:
        assert_error(c.post("/v1/chat/completions", json=body), 400)


def test_bad_bodies_routes_and_keys(server):
    def chunked():
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096

    with httpx.Client(base_url=server, timeout=30) as c:
        post = lambda content, headers=JSON: c.post("/v1/completions", content=content, headers=headers)  # noqa: E731
        assert_error(post(b"{not json"), 400)
        assert "UTF-8" in assert_error(post(b'{"prompt": "\xff\xfe"}'), 400)["message"]
        assert_error(post(b"[1, 2]"), 400)
        assert_error(post(b'"prompt"'), 400)
        assert_error(post(b'{"prompt": [5], "temperature": NaN}'), 400)
        assert_error(post(b'{"prompt": [5]}', {**AUTH, "content-type": "text/plain"}), 400)
        assert_error(post(b"x" * (MAX_BODY + 1)), 413)
        assert_error(post(chunked()), 413)  # no Content-Length: counted while reading
        assert_error(c.get("/v1/nowhere", headers=AUTH), 404)
        assert_error(c.get("/v1/completions", headers=AUTH), 405)
        assert_error(c.post("/v1/completions", json={"prompt": P, "model": "other"}, headers=AUTH), 404)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
            assert_error(c.post(path, json={"prompt": P}), 401)
            assert_error(c.post(path, json={"prompt": P}, headers={"Authorization": "Bearer no"}), 401)
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # no key needed
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 5


def test_many_concurrent_connections(server):
    """64 clients at once, half of them sending garbage: every answer is a 200 or a 4xx."""
    def one(i: int) -> int:
        with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
            if i % 2:
                return c.post("/v1/completions", content=b'{"prompt": [1,', headers=JSON).status_code
            return c.post("/v1/completions", json={"prompt": make_prompt(20, i), "max_tokens": 2}).status_code

    with ThreadPoolExecutor(64) as pool:
        codes = list(pool.map(one, range(64)))
    assert codes.count(200) == 32 and codes.count(400) == 32
    with httpx.Client(base_url=server, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok", "num_unfinished": 0}
        text = c.get("/metrics").text
    assert 'hybridserve_http_responses_total{code="400",route="/v1/completions"}' in text
    assert 'hybridserve_http_responses_total{code="401",route="/v1/completions"}' in text


def _wait(cond, timeout_s: float = 30) -> bool:
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.05)
    return cond()


@pytest.mark.timeout(120)
def test_overload_is_429_and_disconnect_aborts(tiny_model):
    runner = EngineRunner(make_engine(tiny_model, num_spec_tokens=0), max_queued=1)
    body = {"prompt": make_prompt(8, 1), "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with serve_app(create_app(runner, "tiny")) as url, httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # keep it: dropping the iterator closes the connection
                assert next(line for line in lines if line.startswith("data: "))  # it is generating
                busy = c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
                assert assert_error(busy, 429)["type"] == "rate_limit_error"
                assert busy.headers["retry-after"] == "1"
            # leaving the block closed the connection mid-stream: the engine drops the request
            assert _wait(lambda: runner.num_unfinished == 0)
            assert c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                c.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
            assert _wait(lambda: runner.num_unfinished == 0)
            text = c.get("/metrics").text
        assert 'hybridserve_requests_total{status="disconnect"} 2.0' in text
        assert 'hybridserve_http_responses_total{code="429",route="/v1/completions"} 1.0' in text
    finally:
        runner.shutdown()


class FakeBackend:
    """Scripted backend: `mode` picks what `submit` does."""

    num_unfinished = 0
    max_model_len = 64

    def __init__(self) -> None:
        self.mode = "fail_mid_stream"
        self.metrics = None
        self.aborted: list[str] = []

    def attach_metrics(self, metrics) -> None:
        self.metrics = metrics

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def submit(self, prompt, params, cache_salt=None) -> RequestStream:
        if self.mode == "invalid":
            raise InvalidRequestError("the prompt is not welcome here")
        if self.mode == "overloaded":
            raise ServerOverloadedError("all replicas are full", retry_after_s=2.5)
        if self.mode == "crash":
            raise RuntimeError("router lost")
        stream = RequestStream("fake-1")

        def run() -> None:
            stream.put(RequestOutput("fake-1", (5,), (5,), False, None, len(prompt), 0, 0.01, 0, 0))
            time.sleep(0.05)
            stream.put(StreamEnd(RuntimeError("replica died")))

        threading.Thread(target=run, daemon=True).start()
        return stream


def test_backend_failures_are_json_errors_and_sse_error_events():
    backend = FakeBackend()
    with serve_app(create_app(backend, "fake")) as url, httpx.Client(base_url=url, timeout=30) as c:
        body = {"prompt": [5, 6], "max_tokens": 4}
        assert "replica died" in assert_error(c.post("/v1/completions", json=body), 500)["message"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and 'replica died' in lines[-2] and '"error"' in lines[-2]
        assert lines[0].startswith('data: {"id"')  # the token before the failure still arrived
        backend.mode = "invalid"
        assert assert_error(c.post("/v1/completions", json=body), 400)["param"] == "prompt"
        backend.mode = "overloaded"
        assert assert_error(c.post("/v1/completions", json=body), 429) and \
            c.post("/v1/completions", json=body).headers["retry-after"] == "3"
        backend.mode = "crash"
        assert_error(c.post("/v1/completions", json=body), 500)
        assert_error(c.post("/v1/completions", json={"prompt": [5] * 64}), 400)  # max_model_len, before submit
        backend.metrics.record_route("hybrid", "replica-0")
        backend.metrics.record_transfer(True, 0.02, 4096)
        backend.metrics.record_transfer(False, 1.5, 0)
        backend.metrics.record_transfer_skipped()
        text = c.get("/metrics").text
    assert 'hybridserve_routing_decisions_total{policy="hybrid",replica="replica-0"} 1.0' in text
    assert 'hybridserve_transfers_total{outcome="ok"} 1.0' in text
    assert 'hybridserve_transfers_total{outcome="failed"} 1.0' in text
    assert 'hybridserve_transfers_total{outcome="skipped_slow_link"} 1.0' in text
    assert "hybridserve_transfer_seconds_count 2.0" in text and "hybridserve_transfer_bytes_total 4096.0" in text
    assert 'hybridserve_requests_total{status="error"} 2.0' in text


def test_stream_errors_map_to_their_status():
    """A late refusal is a 400, a request no replica could finish a retryable 503, anything else a 500."""
    from cluster.http.streaming import stream_error
    from workers.engine.errors import InvalidRequestError, ServerOverloadedError
    from workers.engine_runner import StreamEnd

    assert stream_error(StreamEnd(InvalidRequestError("too big")))["code"] == 400
    retry = stream_error(StreamEnd(ServerOverloadedError("replica died mid-stream: retry")))
    assert retry["code"] == 503 and "retry" in retry["message"]
    assert stream_error(StreamEnd(RuntimeError("boom")))["code"] == 500
    assert stream_error(StreamEnd())["code"] == 503  # aborted
