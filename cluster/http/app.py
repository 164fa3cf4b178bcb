"""OpenAI-compatible HTTP front end (FastAPI): `/v1/completions`, `/v1/chat/completions` (SSE
streaming or not), `/v1/models[/{id}]`, vLLM's `/tokenize`, `/detokenize`, `/version`,
`/health`, `/metrics` (Prometheus).

The backend is anything with `submit(prompt_token_ids, params, cache_salt) -> RequestStream`
(raising `InvalidRequestError` for bad input, `ServerOverloadedError` when full) and
`num_unfinished`: an `EngineRunner` for one engine, or the Ray cluster. Optional attributes,
read with getattr: `max_model_len` (prompt + max_tokens over it is a 400, as in vLLM),
`abort(request_id)` (called, fire-and-forget, when a client goes away or a stop string ends a
request early), `attach_metrics(metrics)` (called once with the `Metrics`).

Bad input is always a 4xx JSON error in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`), never a 5xx: 400 invalid or unsupported (naming the field), 401 API key, 404 unknown
model or route, 405, 413 body too large, 429 overloaded (with Retry-After). A backend failure is
a 500 JSON error, or, once a stream has started, an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest

from cluster.http.errors import HttpError, install_error_handlers
from cluster.http.guard import HttpGuard
from cluster.http.metrics import Metrics
from cluster.http.openai_format import chat_logprobs, completion_logprobs, sampling_params
from cluster.http.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_docs,
)
from cluster.http.request_driver import RequestDriver
from cluster.text.chat import ChatTemplateError
from cluster.text.completion_state import CompletionState, Increment
from cluster.text.text_model import GenerationDefaults, TextModel
from cluster.text.tokenizer import ByteTokenizer, Tokenizer
from workers.engine.errors import InvalidRequestError

VERSION = "0.1.0"
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                    "/tokenize", "/detokenize", "/version"})
__all__ = ["HttpError", "ROUTES", "create_app"]


def default_text_model(tokenizer: Tokenizer | None) -> TextModel:
    from cluster.text.chat import DEFAULT_TEMPLATE, ChatTemplate

    template = ChatTemplate(DEFAULT_TEMPLATE, origin="built-in") if isinstance(tokenizer, ByteTokenizer) else None
    return TextModel(tokenizer, template, GenerationDefaults())


def create_app(backend, model_name: str, api_key: str | None = None, tokenizer: Tokenizer | None = None,
               max_body_bytes: int = 4 * 2**20, text: TextModel | None = None,
               model_root: str | None = None) -> FastAPI:
    """`text` (tokenizer, chat template, generation defaults; `load_text_model`) enables text
    prompts, chat, `stop` strings and `text` in responses; a bare `tokenizer` is the same with
    the built-in template for the byte tokenizer. Without either, prompts are token ids only."""
    text = text or default_text_model(tokenizer)
    tokenizer = text.tokenizer
    app = FastAPI(title="hybridserve", version=VERSION)
    metrics = app.state.metrics = Metrics()
    metrics.num_unfinished.set_function(lambda: backend.num_unfinished)
    if hasattr(backend, "attach_metrics"):
        backend.attach_metrics(metrics)
    if hasattr(backend, "engine_stats"):
        metrics.attach_engine_stats(backend.engine_stats)
    max_model_len: int | None = getattr(backend, "max_model_len", None)
    created = int(time.time())
    driver = RequestDriver(backend, metrics)
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, routes=ROUTES)
    install_error_handlers(app)

    def check(body) -> None:
        if body.model not in (None, model_name):
            raise HttpError(404, f"model {body.model!r} not found; this server has {model_name!r}",
                            "not_found_error", "model")
        problem = body.unsupported() if hasattr(body, "unsupported") else None
        if problem is not None:
            raise HttpError(400, problem[1], param=problem[0])

    def need_tokenizer(what: str) -> Tokenizer:
        if tokenizer is None:
            raise HttpError(400, f"this model has no tokenizer: {what}", param="prompt")
        return tokenizer

    def render_chat(messages, add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        tok = need_tokenizer("chat needs text")
        if text.chat_template is None:
            raise HttpError(400, "this model has no chat template (tokenizer_config.json chat_template or "
                            "chat_template.jinja); start the server with --chat-template", param="messages")
        try:
            rendered = text.chat_template.render(messages, add_generation_prompt, **(kwargs or {}))
        except ChatTemplateError as exc:
            raise HttpError(400, str(exc), param="messages") from None
        return tok.encode(rendered, add_special_tokens=False)

    def params_for(body: SamplingFields, prompt: list[int], max_tokens: int | None, logprobs: int | None):
        if body.stop_strings:
            need_tokenizer("stop strings are matched on text: use stop_token_ids")
        if max_tokens is None:
            max_tokens = text.generation.max_new_tokens or (max_model_len - len(prompt) if max_model_len else 256)
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            raise HttpError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                            "completion.", param="max_tokens" if len(prompt) < max_model_len else "prompt")
        try:
            return sampling_params(body, max(1, max_tokens), logprobs, text.generation.sampling,
                                   text.stop_token_ids)
        except InvalidRequestError as exc:
            raise HttpError(400, str(exc), param=str(exc).split()[0]) from None

    def new_state(body: SamplingFields) -> CompletionState:
        return CompletionState(tokenizer, body.stop_strings, body.stop_token_ids or (),
                               body.include_stop_str_in_output, body.skip_special_tokens)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "num_unfinished": backend.num_unfinished}

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "hybridserve",
                "root": model_root or model_name, "parent": None, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=error_docs(401, 404))
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise HttpError(404, f"model {model_id!r} not found; this server has {model_name!r}", "not_found_error",
                            "model")
        return model_card()

    @app.post("/tokenize", responses=error_docs(400, 404, 413))
    async def tokenize(body: TokenizeRequest) -> dict:
        check(body)
        if (body.prompt is None) == (body.messages is None):
            raise HttpError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        else:
            ids = need_tokenizer("tokenize needs a tokenizer").encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=error_docs(400, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> dict:
        check(body)
        return {"prompt": need_tokenizer("detokenize needs a tokenizer").decode(body.tokens)}

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        started_s = time.perf_counter()
        check(body)
        if isinstance(body.prompt, str):
            prompt = need_tokenizer("send `prompt` as a list of token ids").encode(body.prompt, body.add_special_tokens)
            prompt_text = body.prompt
        elif body.prompt and not isinstance(body.prompt[0], int):
            raise HttpError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        else:
            prompt = list(body.prompt)
            prompt_text = tokenizer.decode(prompt) if tokenizer else ""
        stream = await driver.submit(prompt, params_for(body, prompt, body.max_tokens, body.logprobs), body.cache_salt)
        state = new_state(body)
        echo = prompt_text if body.echo else ""
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        def logprobs(token_ids, lps, offset: int):
            return completion_logprobs(tokenizer, token_ids, lps, offset) if lps is not None else None

        if not body.stream:
            await driver.run(stream, request, started_s, state)
            choice = {"index": 0, "text": echo + state.text, "token_ids": state.token_ids,
                      "logprobs": logprobs(state.token_ids, state.logprobs, len(echo)),
                      "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
            return {**head, "choices": [choice], "usage": state.usage()}
        sent = [False]

        def chunks(inc: Increment) -> list[dict]:
            if not inc.token_ids and not inc.finished and not inc.text:
                return []  # a prefill chunk: nothing to say yet
            shown = inc.text
            if not sent[0]:
                sent[0], shown = True, echo + shown
            choice = {"index": 0, "text": shown, "token_ids": list(inc.token_ids),
                      "logprobs": logprobs(inc.token_ids, inc.logprobs, len(echo) + len(state.text) - len(inc.text)),
                      "finish_reason": inc.finish_reason if inc.finished else None,
                      "stop_reason": inc.stop_reason if inc.finished else None}
            chunk = {**head, "choices": [choice]}
            if inc.finished or (body.stream_options and body.stream_options.continuous_usage_stats):
                chunk["usage"] = state.usage()
            return [chunk]

        return driver.sse(stream, started_s, state, chunks)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        started_s = time.perf_counter()
        check(body)
        prompt = render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        stream = await driver.submit(prompt, params_for(body, prompt, body.num_max_tokens, num_top), body.cache_salt)
        state = new_state(body)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}

        def logprobs(token_ids, lps):
            return chat_logprobs(tokenizer, token_ids, lps) if lps is not None else None

        if not body.stream:
            await driver.run(stream, request, started_s, state)
            message = {"role": "assistant", "content": state.text, "tool_calls": []}
            return {**head, "object": "chat.completion", "usage": state.usage(),
                    "choices": [{"index": 0, "message": message, "finish_reason": state.finish_reason,
                                 "stop_reason": state.stop_reason,
                                 "logprobs": logprobs(state.token_ids, state.logprobs)}]}
        head = {**head, "object": "chat.completion.chunk"}
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        started = [False]

        def chunks(inc: Increment) -> list[dict]:
            deltas = []
            if not started[0]:
                started[0] = True
                deltas.append(({"role": "assistant", "content": ""}, None))
            if inc.text or (inc.token_ids and inc.logprobs is not None):
                deltas.append(({"content": inc.text}, logprobs(inc.token_ids, inc.logprobs)))
            events = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": lp}]}
                      for d, lp in deltas]
            if inc.finished:
                events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": inc.finish_reason,
                                                    "stop_reason": inc.stop_reason, "logprobs": None}]})
                if body.include_usage:
                    events.append({**head, "choices": [], "usage": state.usage()})
            if continuous:
                events = [{**e, "usage": state.usage()} if e["choices"] else e for e in events]
            return events

        return driver.sse(stream, started_s, state, chunks)

    return app
