"""Request bodies of the OpenAI-compatible API and its error shape.

Bodies are strict: unknown fields, wrong JSON types (`"16"` for an integer, `true` for a token
id) and out-of-range values are rejected with 400 before anything reaches the backend. Every
field the OpenAI SDK can send is accepted at its default value; a field whose non-default value
asks for something this server does not do (`n` > 1, `tools`, `logit_bias`, a JSON
`response_format`, ...) is a 400 naming that field (`unsupported()`), never silently ignored.
Fields that do not change the output (`user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls`) are accepted and ignored. Extensions (vLLM's names): `top_k`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output`, `add_special_tokens`, `cache_salt`; chat also
`add_generation_prompt`, `chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.text.chat import Role
from workers.engine.sampling_params import MAX_LOGPROBS

MAX_TOKENS_LIMIT = 2**20  # schema bound; the backend's max_model_len is the real one
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes
StopString = Annotated[str, Field(min_length=1, max_length=256)]
Stop = StopString | Annotated[list[StopString], Field(max_length=16)] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) when a field asks for something this server does not do; None: all fine."""
        return None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Strict):
    model: str | None = None
    # None: generation_config.json's value, else OpenAI's default (temperature 1.0; 0 = greedy)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0**31)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=128)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        """A stream ends with one extra chunk holding `usage` and no choices (OpenAI, vLLM)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every chunk with choices also carries `usage` (vLLM: only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field asking for something this server does not do."""
        if self.n != 1:
            return "n", "n > 1 is not supported: send n requests"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", f"response_format {self.response_format.type!r} is not supported (only text)"
        if self.min_p:
            return "min_p", "min_p is not supported"
        if self.priority:
            return "priority", "priority scheduling is not supported"
        return None


class CompletionRequest(SamplingFields):
    """`prompt`: text (needs the model's tokenizer) or token ids; lists of prompts are rejected."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1)] | Annotated[list[list[int]], Field(min_length=1)])
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs needs prompt logprobs, which are not supported"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Function(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: Function


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    """`max_completion_tokens` wins over the older `max_tokens`; neither given means the rest of
    `max_model_len` (or generation_config.json's `max_new_tokens`), as vLLM does."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False

    @property
    def num_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported (no tools)"
        if self.functions:
            return "functions", "functions (function calling) are not supported"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", "function_call is not supported"
        if self.modalities not in (None, ["text"]):
            return "modalities", "only the text modality is supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        if self.prediction is not None:
            return "prediction", "predicted outputs are not supported"
        if self.reasoning_effort is not None:
            return "reasoning_effort", "reasoning_effort is not supported"
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported"
        if self.continue_final_message:
            return "continue_final_message", "continue_final_message is not supported"
        if self.echo:
            return "echo", "echo is not supported for chat completions"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                return f"messages.{i}.tool_calls", "tool calls are not supported"
            if m.role == "tool":
                return f"messages.{i}.role", "tool messages are not supported (no tools)"
            if m.content is None and m.role != "assistant":
                return f"messages.{i}.content", f"a {m.role} message needs content (only assistant content may be null)"
        return super().unsupported()


class TokenizeRequest(_Strict):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_LIMIT)


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


ERROR_DOCS = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
              413: "body over http.max_body_bytes", 429: "server overloaded: see Retry-After", 500: "backend failure"}


def error_docs(*codes: int) -> dict[int | str, dict]:
    """OpenAPI `responses` for a route that can answer with these error codes."""
    return {code: {"model": ErrorBody, "description": ERROR_DOCS[code]} for code in codes}


ERROR_RESPONSES: dict[int | str, dict] = {
    200: {"description": "a JSON completion, or an SSE stream of chunks with `stream: true`",
          "content": {"application/json": {}, "text/event-stream": {}}},
} | {
    code: {"model": ErrorBody, "description": what}
    for code, what in [(400, "invalid request"), (401, "missing or invalid API key"), (404, "unknown model"),
                       (413, "body over http.max_body_bytes"), (429, "server overloaded: see Retry-After"),
                       (500, "backend failure")]
}
