"""Request bodies of the OpenAI-compatible API and its error shape.

Bodies are strict: unknown fields, wrong JSON types (`"16"` for an integer, `true` for a token
id) and out-of-range values are rejected with 400 before anything reaches the backend.
Extensions beyond OpenAI's fields: `top_k`, `stop_token_ids`, `ignore_eos`, `cache_salt`.
`stop` is token-level: each stop string must encode to exactly one token.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.chat import Role

MAX_TOKENS_LIMIT = 2**20  # schema bound; the backend's max_model_len is the real one
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes
Stop = str | Annotated[list[str], Field(max_length=16)] | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str | None = None
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """`prompt`: text (needs the model's tokenizer) or token ids; lists of prompts are rejected."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1)] | Annotated[list[list[int]], Field(min_length=1)])
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """`max_completion_tokens` wins over the older `max_tokens`; neither given means 256."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)

    @property
    def num_max_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status, headers=headers)


ERROR_RESPONSES: dict[int | str, dict] = {
    200: {"description": "a JSON completion, or an SSE stream of chunks with `stream: true`",
          "content": {"application/json": {}, "text/event-stream": {}}},
} | {
    code: {"model": ErrorBody, "description": what}
    for code, what in [(400, "invalid request"), (401, "missing or invalid API key"), (404, "unknown model"),
                       (413, "body over http.max_body_bytes"), (429, "server overloaded: see Retry-After"),
                       (500, "backend failure")]
}
