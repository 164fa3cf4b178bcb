"""OpenAI-compatible HTTP front end (FastAPI): `/v1/completions`, `/v1/chat/completions` (SSE
streaming or not), `/v1/models`, `/health`, `/metrics` (Prometheus).

The backend is anything with `submit(prompt_token_ids, params, cache_salt) -> RequestStream`
(raising `InvalidRequestError` for bad input, `ServerOverloadedError` when full) and
`num_unfinished`: an `EngineRunner` for one engine, or the Ray cluster. Optional attributes,
read with getattr: `max_model_len` (reject long prompts before submitting), `abort(request_id)`
(called, fire-and-forget, when a client goes away), `attach_metrics(metrics)` (called once with
the `Metrics` so the backend can `record_route` / `record_transfer`).

Bad input is always a 4xx JSON error in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`), never a 5xx: 400 invalid, 401 API key, 404 unknown model or route, 405, 413 body
too large, 429 overloaded (with Retry-After). A backend failure is a 500 JSON error, or, once a
stream has started, an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.chat import render_chat
from cluster.http_guard import HttpGuard
from cluster.metrics import Metrics
from cluster.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_response,
)
from cluster.streaming import SseResponse, follow, last_item, sse_event, stream_error, usage
from cluster.tokenizer import IncrementalDecoder, Tokenizer
from workers.engine.errors import InvalidRequestError, ServerOverloadedError
from workers.engine.request import RequestOutput
from workers.engine.sampling import SamplingParams
from workers.engine_runner import RequestStream, StreamEnd

log = logging.getLogger(__name__)


def visible(ids: tuple[int, ...], out: RequestOutput) -> list[int]:
    """The ids whose text is shown: a request that finished on a stop token (or EOS) keeps that
    token in `token_ids` but not in `text`, as OpenAI leaves stop sequences out."""
    return list(ids[:-1] if out.finished and out.finish_reason == "stop" and ids else ids)
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = error_response(status, message, kind, param, headers)


def create_app(backend, model_name: str, api_key: str | None = None, tokenizer: Tokenizer | None = None,
               max_body_bytes: int = 4 * 2**20) -> FastAPI:
    """`tokenizer` (encode/decode) enables text prompts, chat, `stop` strings and `text` in
    responses; without it prompts are token ids and `text` is empty."""
    app = FastAPI(title="hybridserve", version="0.1.0")
    metrics = app.state.metrics = Metrics()
    metrics.num_unfinished.set_function(lambda: backend.num_unfinished)
    if hasattr(backend, "attach_metrics"):
        backend.attach_metrics(metrics)
    max_model_len: int | None = getattr(backend, "max_model_len", None)
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, routes=ROUTES)

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ())[1:]]
        param = loc[0] if loc else None
        if first.get("type") in ("json_invalid", "model_attributes_type") or not loc:
            return error_response(400, "the body must be a JSON object sent as Content-Type: application/json "
                                  f"({first.get('msg', 'invalid JSON')})")
        if param == "prompt" and len(loc) > 1 and first.get("type") not in ("missing",):
            empty = any(e.get("type") in ("string_too_short", "too_short") for e in exc.errors())
            message = "the prompt is empty" if empty else "prompt must be a string or a list of token ids"
            return error_response(400, message, param=param)
        return error_response(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = "the body is not valid UTF-8 JSON" if exc.status_code == 400 else str(exc.detail)
        return error_response(exc.status_code, message, kind, headers=getattr(exc, "headers", None))

    def check_model(body: SamplingFields) -> None:
        if body.model not in (None, model_name):
            raise HttpError(404, f"model {body.model!r} not found; this server has {model_name!r}",
                            "not_found_error", "model")

    def need_tokenizer(what: str) -> Tokenizer:
        if tokenizer is None:
            raise HttpError(400, f"this model has no tokenizer: {what}", param="prompt")
        return tokenizer

    def sampling(body: SamplingFields, max_tokens: int) -> SamplingParams:
        stops = list(body.stop_token_ids)
        for s in [body.stop] if isinstance(body.stop, str) else body.stop or []:
            ids = need_tokenizer("use stop_token_ids instead of stop").encode(s)
            if len(ids) != 1:
                raise HttpError(400, f"stop {s!r} is {len(ids)} tokens; stop strings must be exactly one token "
                                "(this server stops on tokens, not on text)", param="stop")
            stops += ids
        if max_model_len is not None and max_tokens > max_model_len:
            raise HttpError(400, f"max_tokens {max_tokens} is over max_model_len {max_model_len}", param="max_tokens")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, stop_token_ids=tuple(stops),
                                  ignore_eos=body.ignore_eos)
        except InvalidRequestError as exc:
            raise HttpError(400, str(exc)) from None

    async def submit(prompt: list[int], params: SamplingParams, cache_salt: str | None) -> RequestStream:
        if not prompt:
            raise HttpError(400, "the prompt is empty", param="prompt")
        if max_model_len is not None and len(prompt) >= max_model_len:
            raise HttpError(400, f"the prompt has {len(prompt)} tokens; max_model_len is {max_model_len} "
                            "(prompt + at least 1 output)", param="prompt")
        try:  # in a thread: a backend's submit may wait for its engine step to end
            return await asyncio.to_thread(backend.submit, prompt, params, cache_salt)
        except InvalidRequestError as exc:
            param = "prompt" if "prompt" in str(exc) or "token" in str(exc) else None
            raise HttpError(400, str(exc), param=param) from None
        except ServerOverloadedError as exc:
            retry = max(1, math.ceil(exc.retry_after_s))
            raise HttpError(429, f"server overloaded: {exc}", "rate_limit_error",
                            headers={"Retry-After": str(retry)}) from None
        except Exception as exc:
            log.exception("backend submit failed")
            raise HttpError(500, f"backend failed: {exc}", "server_error") from None

    def abort(stream: RequestStream, status: str) -> None:
        metrics.record_failure(status)
        if hasattr(backend, "abort"):  # fire-and-forget: never block (or await in) a cancelled task
            asyncio.get_running_loop().run_in_executor(None, backend.abort, stream.request_id)

    async def final_output(stream: RequestStream, request: Request, started_s: float) -> RequestOutput:
        """Waits for the finished output, aborting the request if the client goes away."""
        task = asyncio.ensure_future(last_item(follow(stream, metrics, started_s)))
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await request.is_disconnected():
                task.cancel()
                abort(stream, "disconnect")
                raise HttpError(499, "client disconnected")
        item = task.result()
        if isinstance(item, StreamEnd):
            error = stream_error(item)
            raise HttpError(error["code"], error["message"], error["type"])
        return item

    def streaming(stream: RequestStream, started_s: float, chunks) -> StreamingResponse:
        """SSE over `chunks(item) -> list[dict]`; ends with `[DONE]`, after an error event if the
        backend failed; aborts the request if the client goes away first."""

        async def events():
            done = False
            try:
                async for item in follow(stream, metrics, started_s):
                    if isinstance(item, StreamEnd):
                        done = True
                        yield sse_event({"error": stream_error(item)})
                        break
                    done = item.finished
                    for chunk in chunks(item):
                        yield sse_event(chunk)
                yield sse_event("[DONE]")
            finally:
                if not done:
                    abort(stream, "disconnect")

        return SseResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "num_unfinished": backend.num_unfinished}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hybridserve"}]}

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        started_s = time.perf_counter()
        check_model(body)
        if isinstance(body.prompt, str):
            prompt = need_tokenizer("send `prompt` as a list of token ids").encode(body.prompt)
        elif body.prompt and not isinstance(body.prompt[0], int):
            raise HttpError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        else:
            prompt = list(body.prompt)
        stream = await submit(prompt, sampling(body, body.max_tokens), body.cache_salt)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if not body.stream:
            out = await final_output(stream, request, started_s)
            text = tokenizer.decode(visible(out.token_ids, out)) if tokenizer else ""
            return {**head, "choices": [{"index": 0, "text": text, "token_ids": list(out.token_ids),
                                         "finish_reason": out.finish_reason, "logprobs": None}],
                    "usage": usage(out)}
        decoder = IncrementalDecoder(tokenizer) if tokenizer else None

        def chunks(out: RequestOutput) -> list[dict]:
            if not out.new_token_ids and not out.finished:
                return []  # a prefill chunk: nothing to say yet
            text = decoder.feed(visible(out.new_token_ids, out), final=out.finished) if decoder else ""
            chunk = {**head, "choices": [{"index": 0, "text": text, "token_ids": list(out.new_token_ids),
                                          "finish_reason": out.finish_reason if out.finished else None}]}
            return [{**chunk, "usage": usage(out)}] if out.finished else [chunk]

        return streaming(stream, started_s, chunks)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        started_s = time.perf_counter()
        check_model(body)
        prompt = need_tokenizer("chat needs text").encode(render_chat(body.messages))
        stream = await submit(prompt, sampling(body, body.num_max_tokens), body.cache_salt)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        if not body.stream:
            out = await final_output(stream, request, started_s)
            message = {"role": "assistant", "content": tokenizer.decode(visible(out.token_ids, out))}
            return {**head, "object": "chat.completion", "usage": usage(out),
                    "choices": [{"index": 0, "message": message, "finish_reason": out.finish_reason,
                                 "logprobs": None}]}
        decoder = IncrementalDecoder(tokenizer)
        head = {**head, "object": "chat.completion.chunk"}
        started = [False]

        def chunks(out: RequestOutput) -> list[dict]:
            text = decoder.feed(visible(out.new_token_ids, out), final=out.finished)
            result = []
            if not started[0]:
                started[0] = True
                result.append({"role": "assistant", "content": ""})
            if text:
                result.append({"content": text})
            events = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}]}
                      for d in result]
            if out.finished:
                events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": out.finish_reason,
                                                    "logprobs": None}]})
                if body.include_usage:
                    events.append({**head, "choices": [], "usage": usage(out)})
            return events

        return streaming(stream, started_s, chunks)

    return app
