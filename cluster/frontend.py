"""OpenAI-compatible HTTP front end (FastAPI): `/v1/completions` (SSE streaming or not),
`/v1/models`, `/health`, `/metrics` (Prometheus).

This version serves one engine through an `EngineRunner`; the Ray cluster (router + replicas)
plugs in behind the same `submit` interface. Bad input is always a 4xx JSON error in OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`), never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from workers.engine.errors import InvalidRequestError
from workers.engine.sampling import SamplingParams
from workers.engine_runner import EngineRunner, RequestStream, StreamEnd


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(default=16)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    cache_salt: str | None = None
    user: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hybridserve_requests", "completed requests", ["status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("hybridserve_prompt_tokens", "prompt tokens", registry=self.registry)
        self.cached_tokens = Counter("hybridserve_prefix_cache_hit_tokens", "prompt tokens served from cache",
                                     registry=self.registry)
        self.generated = Counter("hybridserve_generation_tokens", "generated tokens", registry=self.registry)
        self.drafts = Counter("hybridserve_spec_decode_draft_tokens", "draft tokens", ["outcome"],
                              registry=self.registry)
        self.ttft = Histogram("hybridserve_time_to_first_token_seconds", "TTFT", registry=self.registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def record(self, out) -> None:
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_tokens.inc(out.num_cached_tokens)
        self.generated.inc(len(out.token_ids))
        self.drafts.labels("accepted").inc(out.num_draft_accepted)
        self.drafts.labels("rejected").inc(out.num_draft_proposed - out.num_draft_accepted)
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)


async def _next(stream: RequestStream, loop: asyncio.AbstractEventLoop, wake: asyncio.Event):
    while True:
        item = stream.get_nowait()
        if item is not None:
            return item
        wake.clear()
        item = stream.get_nowait()
        if item is not None:
            return item
        await wake.wait()


def create_app(runner: EngineRunner, model_name: str, api_key: str | None = None,
               decode=None) -> FastAPI:
    """`decode(token_ids) -> str` renders text; without it, `text` is empty and token ids are returned."""
    app = FastAPI(title="hybridserve", version="0.1.0")
    metrics = Metrics()
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or invalid API key", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "num_unfinished": runner.num_unfinished}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hybridserve"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model not in (None, model_name):
            return _error(404, f"model {body.model!r} not found; this server has {model_name!r}", param="model")
        if isinstance(body.prompt, str):
            return _error(400, "this model has no tokenizer: send `prompt` as a list of token ids", param="prompt")
        try:
            params = SamplingParams(
                max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                seed=body.seed, stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
            )
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            stream = runner.submit(list(body.prompt), params, body.cache_salt)
            stream.on_item = lambda: loop.call_soon_threadsafe(wake.set)
        except InvalidRequestError as exc:
            return _error(400, str(exc), param="prompt" if "prompt" in str(exc) or "token" in str(exc) else None)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text = decode or (lambda ids: "")

        def usage(out) -> dict:
            return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": len(out.token_ids),
                    "total_tokens": out.num_prompt_tokens + len(out.token_ids),
                    "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

        async def outputs():
            while True:
                item = await _next(stream, loop, wake)
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
                if item.finished:
                    metrics.record(item)
                    return

        if not body.stream:
            final = None
            async for out in outputs():
                final = out
            if final is None:
                return _error(503, "request aborted", "server_error")
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text(list(final.token_ids)), "token_ids": list(final.token_ids),
                                 "finish_reason": final.finish_reason, "logprobs": None}],
                    "usage": usage(final)}

        async def sse():
            async for out in outputs():
                if not out.new_token_ids and not out.finished:
                    continue  # a prefill chunk: nothing to say yet
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [{"index": 0, "text": text(list(out.new_token_ids)),
                                      "token_ids": list(out.new_token_ids),
                                      "finish_reason": out.finish_reason if out.finished else None}]}
                if out.finished:
                    chunk["usage"] = usage(out)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app
