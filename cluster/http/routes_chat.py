"""`/v1/chat/completions`: messages rendered by the chat template, one JSON response or SSE chunks."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from cluster.http.api import Api
from cluster.http.openai_format import chat_logprobs
from cluster.http.protocol import ERROR_RESPONSES, ChatCompletionRequest
from cluster.http.streaming import with_usage
from cluster.ids import completion_id
from cluster.text.completion_state import CompletionState, Increment


def chat_routes(api: Api) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        started_s = time.perf_counter()
        api.check(body)
        prompt = api.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = api.params_for(body, prompt, body.num_max_tokens, num_top)
        response_id = completion_id("chatcmpl")
        stream = await api.driver.submit(prompt, params, body.cache_salt, response_id)
        state = api.new_state(body)
        head = {"id": response_id, "created": int(time.time()), "model": api.model_name}
        if not body.stream:
            await api.driver.run(stream, request, started_s, state)
            message = {"role": "assistant", "content": state.text, "tool_calls": []}
            return {**head, "object": "chat.completion", "usage": state.usage(),
                    "choices": [{"index": 0, "message": message, "finish_reason": state.finish_reason,
                                 "stop_reason": state.stop_reason,
                                 "logprobs": _logprobs(api, state.token_ids, state.logprobs)}]}
        head = {**head, "object": "chat.completion.chunk"}
        return api.driver.sse(stream, started_s, state, _chunker(api, body, state, head))

    return router


def _logprobs(api: Api, token_ids, lps):
    return chat_logprobs(api.tokenizer, token_ids, lps) if lps is not None else None


def _chunker(api: Api, body: ChatCompletionRequest, state: CompletionState, head: dict):
    """increment -> the SSE chunks it makes: the role first, content deltas, then the finish
    reason (usage as `streaming.with_usage` adds it)."""
    started = [False]

    def chunks(inc: Increment) -> list[dict]:
        deltas = []
        if not started[0]:
            started[0] = True
            deltas.append(({"role": "assistant", "content": ""}, None))
        if inc.text or (inc.token_ids and inc.logprobs is not None):
            deltas.append(({"content": inc.text}, _logprobs(api, inc.token_ids, inc.logprobs)))
        events = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": lp}]}
                  for d, lp in deltas]
        if inc.finished:
            events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": inc.finish_reason,
                                                "stop_reason": inc.stop_reason, "logprobs": None}]})
        return with_usage(body, state, head, events, inc.finished)

    return chunks
