"""`/v1/completions`: one prompt (text or token ids), one JSON response or SSE chunks."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from cluster.http.api import Api
from cluster.http.errors import HttpError
from cluster.http.openai_format import completion_logprobs
from cluster.http.protocol import ERROR_RESPONSES, CompletionRequest
from cluster.http.streaming import with_usage
from cluster.ids import completion_id
from cluster.text.completion_state import CompletionState, Increment


def completion_routes(api: Api) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        started_s = time.perf_counter()
        api.check(body)
        prompt, prompt_text = _prompt(api, body)
        params = api.params_for(body, prompt, body.max_tokens, body.logprobs)
        response_id = completion_id("cmpl")
        stream = await api.driver.submit(prompt, params, body.cache_salt, response_id)
        state = api.new_state(body)
        echo = prompt_text if body.echo else ""
        head = {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": api.model_name}
        if not body.stream:
            await api.driver.run(stream, request, started_s, state)
            choice = {"index": 0, "text": echo + state.text, "token_ids": state.token_ids,
                      "logprobs": _logprobs(api, state.token_ids, state.logprobs, len(echo)),
                      "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
            return {**head, "choices": [choice], "usage": state.usage()}
        return api.driver.sse(stream, started_s, state, _chunker(api, body, state, head, echo))

    return router


def _prompt(api: Api, body: CompletionRequest) -> tuple[list[int], str]:
    """(prompt ids, prompt text for `echo`)."""
    if isinstance(body.prompt, str):
        tok = api.need_tokenizer("send `prompt` as a list of token ids")
        return tok.encode(body.prompt, body.add_special_tokens), body.prompt
    if body.prompt and not isinstance(body.prompt[0], int):
        raise HttpError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    prompt = list(body.prompt)
    return prompt, api.tokenizer.decode(prompt) if api.tokenizer else ""


def _logprobs(api: Api, token_ids, lps, offset: int):
    return completion_logprobs(api.tokenizer, token_ids, lps, offset) if lps is not None else None


def _chunker(api: Api, body: CompletionRequest, state: CompletionState, head: dict, echo: str):
    """increment -> the SSE chunks it makes (the echoed prompt rides the first)."""
    sent = [False]

    def chunks(inc: Increment) -> list[dict]:
        if not inc.token_ids and not inc.finished and not inc.text:
            return []  # a prefill chunk: nothing to say yet
        shown = inc.text
        if not sent[0]:
            sent[0], shown = True, echo + shown
        offset = len(echo) + len(state.text) - len(inc.text)
        choice = {"index": 0, "text": shown, "token_ids": list(inc.token_ids),
                  "logprobs": _logprobs(api, inc.token_ids, inc.logprobs, offset),
                  "finish_reason": inc.finish_reason if inc.finished else None,
                  "stop_reason": inc.stop_reason if inc.finished else None}
        return with_usage(body, state, head, [{**head, "choices": [choice]}], inc.finished)

    return chunks
