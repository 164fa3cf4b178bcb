"""Text in and out: the byte tokenizer, incremental UTF-8 decoding across stream chunks (exact for
byte-level tokenizers, held back for generic ones), and text completions on the trained checkpoint."""

import json
import threading
from pathlib import Path

import httpx
import pytest

from cluster.http.app import create_app
from cluster.text.detokenizer import IncrementalDecoder
from cluster.text.tokenizer import ByteTokenizer, load_tokenizer
from tests.cluster.test_frontend_http import serve_app
from workers.engine.request import RequestOutput
from workers.engine_runner import RequestStream

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"
TEXT = "héllo ✓ wörld 😀!"


def test_incremental_decoder_never_splits_a_character():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    dec = IncrementalDecoder(tok)
    pieces = [dec.feed([i]) for i in ids]
    assert "".join(pieces) + dec.feed([], final=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(tok.encode("😀")[0]):][:4] == ["", "", "", "😀"]  # 4 bytes, one character


def test_incomplete_tail_becomes_a_replacement_char_like_decode():
    tok = ByteTokenizer()
    ids = tok.encode("ok ✓")[:-1] + [2]  # cut inside the last character, then EOS
    dec = IncrementalDecoder(tok)
    streamed = "".join(dec.feed([i], final=n == len(ids) - 1) for n, i in enumerate(ids))
    assert streamed == tok.decode(ids) == "ok \ufffd"


class _CharTokenizer:
    """A generic tokenizer without decode_bytes: ids are bytes, but decode sees only whole lists."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_generic_tokenizer_holds_back_the_incomplete_tail():
    tok = _CharTokenizer()
    dec = IncrementalDecoder(tok)
    ids = tok.encode(TEXT)
    pieces = [dec.feed([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)


def test_load_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tok = load_tokenizer(TRAINED)
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.eos_token_id == 2


class ByteStreamBackend:
    """Streams the bytes of TEXT one token per output, like a model emitting a multi-byte char."""

    num_unfinished = 0
    max_model_len = None

    def abort(self, request_id: str) -> None:
        pass

    def attach_metrics(self, metrics) -> None:
        pass

    def submit(self, prompt, params, cache_salt=None) -> RequestStream:
        ids = ByteTokenizer().encode(TEXT)
        stream = RequestStream("bytes-1")

        def run() -> None:
            for n in range(len(ids)):
                done = n == len(ids) - 1
                stream.put(RequestOutput("bytes-1", (ids[n],), tuple(ids[:n + 1]), done, "length" if done else None,
                                         len(prompt), 0, 0.01, 0, 0))

        threading.Thread(target=run, daemon=True).start()
        return stream


def test_streamed_text_is_correct_across_chunk_boundaries():
    with serve_app(create_app(ByteStreamBackend(), "bytes", tokenizer=ByteTokenizer())) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        full = c.post("/v1/completions", json={"prompt": "x", "temperature": 0}).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True, "temperature": 0}) as r:
            texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                     if line.startswith("data: {")]
        with c.stream("POST", "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
    assert full == TEXT
    assert "".join(texts) == TEXT and all("\ufffd" not in t for t in texts)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == TEXT


@pytest.fixture(scope="module")
def trained_server():
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine_runner import EngineRunner

    engine = LLMEngine.from_checkpoint(str(TRAINED), EngineConfig(kernels="torch", max_model_len=1024,
                                                                  cache_memory_bytes=64 * 2**20))
    runner = EngineRunner(engine)
    with serve_app(create_app(runner, "tiny-trained", tokenizer=load_tokenizer(TRAINED))) as url:
        yield url
    runner.shutdown()


@pytest.mark.timeout(120)
def test_text_completion_on_the_trained_checkpoint(trained_server):
    body = {"prompt": "def __init__(self, ", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=trained_server, timeout=60) as c:
        out = c.post("/v1/completions", json=body).json()
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        stopped = c.post("/v1/completions", json={**body, "stop": ["\n", " "], "max_tokens": 200}).json()
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == len("def __init__(self, ")
    assert choice["text"] == ByteTokenizer().decode(choice["token_ids"]) and choice["text"].strip()
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == choice["text"]
    # token-level stop: the stop token ends the request, stays in token_ids, is left out of text
    s = stopped["choices"][0]
    assert s["finish_reason"] == "stop" and s["token_ids"][-1] in (ord("\n") + 3, ord(" ") + 3)
    assert s["text"] == ByteTokenizer().decode(s["token_ids"][:-1])
