"""vLLM's `/tokenize` (a prompt or chat messages -> ids) and `/detokenize`."""

from __future__ import annotations

from fastapi import APIRouter

from cluster.http.api import Api
from cluster.http.errors import HttpError
from cluster.http.protocol import DetokenizeRequest, TokenizeRequest, error_docs


def token_routes(api: Api) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", responses=error_docs(400, 404, 413))
    async def tokenize(body: TokenizeRequest) -> dict:
        api.check(body)
        if (body.prompt is None) == (body.messages is None):
            raise HttpError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = api.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        else:
            ids = api.need_tokenizer("tokenize needs a tokenizer").encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": api.max_model_len, "tokens": ids}

    @router.post("/detokenize", responses=error_docs(400, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> dict:
        api.check(body)
        return {"prompt": api.need_tokenizer("detokenize needs a tokenizer").decode(body.tokens)}

    return router
