"""What every route group shares: the model, its text pieces, the backend, and the checks that
turn a request body into (prompt ids, `SamplingParams`) or a 4xx."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.http.backend import Backend
from cluster.http.errors import HttpError
from cluster.http.metrics import Metrics
from cluster.http.openai_format import sampling_params
from cluster.http.protocol import SamplingFields
from cluster.http.request_driver import RequestDriver
from cluster.text.chat import ChatTemplateError
from cluster.text.completion_state import CompletionState
from cluster.text.text_model import TextModel
from cluster.text.tokenizer import Tokenizer
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

VERSION = "0.1.0"


@dataclass
class Api:
    backend: Backend
    model_name: str
    text: TextModel
    metrics: Metrics
    driver: RequestDriver
    model_root: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.text.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self.backend.max_model_len

    def check(self, body) -> None:
        """404 for another model's name; 400 for a field asking what this server does not do."""
        if body.model not in (None, self.model_name):
            raise HttpError(404, f"model {body.model!r} not found; this server has {self.model_name!r}",
                            "not_found_error", "model")
        problem = body.unsupported()
        if problem is not None:
            raise HttpError(400, problem[1], param=problem[0])

    def need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise HttpError(400, f"this model has no tokenizer: {what}", param="prompt")
        return self.tokenizer

    def render_chat(self, messages, add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        tok = self.need_tokenizer("chat needs text")
        if self.text.chat_template is None:
            raise HttpError(400, "this model has no chat template (tokenizer_config.json chat_template or "
                            "chat_template.jinja); start the server with --chat-template", param="messages")
        try:
            rendered = self.text.chat_template.render(messages, add_generation_prompt, **(kwargs or {}))
        except ChatTemplateError as exc:
            raise HttpError(400, str(exc), param="messages") from None
        return tok.encode(rendered, add_special_tokens=False)

    def params_for(self, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                   logprobs: int | None) -> SamplingParams:
        max_model_len = self.max_model_len
        if body.stop_strings:
            self.need_tokenizer("stop strings are matched on text: use stop_token_ids")
        if max_tokens is None:
            max_tokens = self.text.generation.max_new_tokens or (
                max_model_len - len(prompt) if max_model_len else 256)
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            raise HttpError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                            "completion.", param="max_tokens" if len(prompt) < max_model_len else "prompt")
        try:
            return sampling_params(body, max(1, max_tokens), logprobs, self.text.generation.sampling,
                                   self.text.stop_token_ids)
        except InvalidRequestError as exc:
            raise HttpError(400, str(exc), param=str(exc).split()[0]) from None

    def new_state(self, body: SamplingFields) -> CompletionState:
        return CompletionState(self.tokenizer, body.stop_strings, body.stop_token_ids or (),
                               body.include_stop_str_in_output, body.skip_special_tokens)
