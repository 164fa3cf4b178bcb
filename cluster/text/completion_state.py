"""One request's output as the API shows it, built up from the engine's `RequestOutput`s.

The engine stops on tokens (EOS, `stop_token_ids`, the length limit); the API also stops on text
(`stop` strings). `CompletionState.update` turns each engine output into an `Increment`: the text
to show now, the tokens (and their logprobs) it covers, and whether the request is over. When a
stop string matches, the increment is final even though the engine has not finished: the caller
aborts the engine request, and the tokens after the match are neither counted nor shown.
A request that ends on a stop token keeps it in `token_ids` but not in the text (OpenAI leaves
stop sequences out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.text.detokenizer import TextStream
from cluster.text.tokenizer import Tokenizer
from workers.engine.request import RequestOutput
from workers.engine.sampling import TokenLogprobs


@dataclass(frozen=True)
class Increment:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it (vLLM's field)


class CompletionState:
    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.text_stream = TextStream(_SkipSpecial(tokenizer, skip_special_tokens), stop, include_stop) \
            if tokenizer is not None else None
        self.explicit_stop_ids = frozenset(stop_token_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.text = ""
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_computed_prompt_tokens = 0

    def update(self, out: RequestOutput) -> Increment:
        self.num_prompt_tokens, self.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        self.num_computed_prompt_tokens = out.num_computed_prompt_tokens
        new = list(out.new_token_ids)
        ends_on_token = out.finished and out.finish_reason == "stop" and bool(new)
        shown = new[:-1] if ends_on_token else new
        text, consumed = "", len(new)
        if self.text_stream is not None:
            text, used = self.text_stream.feed(shown, final=out.finished)
            if self.text_stream.stopped:
                consumed = used
        taken = new[:consumed]
        logprobs = tuple(out.logprobs[:consumed]) if out.logprobs is not None else None
        self.token_ids += taken
        if logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *logprobs]
        self.text += text
        if self.text_stream is not None and self.text_stream.stopped:
            self.finished, self.finish_reason, self.stop_reason = True, "stop", self.text_stream.matched_stop
        elif out.finished:
            self.finished, self.finish_reason = True, out.finish_reason
            if ends_on_token and new[-1] in self.explicit_stop_ids:
                self.stop_reason = new[-1]
        return Increment(text, tuple(taken), logprobs, self.finished, self.finish_reason, self.stop_reason)

    def usage(self) -> dict:
        n = len(self.token_ids)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": n,
                "total_tokens": self.num_prompt_tokens + n,
                "prompt_tokens_details": prompt_tokens_details(self.num_cached_tokens,
                                                               self.num_computed_prompt_tokens)}


def prompt_tokens_details(num_cached: int, num_computed: int) -> dict:
    """OpenAI's `usage.prompt_tokens_details` (`cached_tokens`) plus `computed_tokens`, the prompt tokens
    the model actually ran (an extension field: OpenAI clients keep unknown fields)."""
    return {"cached_tokens": num_cached, "computed_tokens": num_computed}


class _SkipSpecial:
    """The tokenizer with `decode`'s skip_special_tokens fixed (the request's choice)."""

    def __init__(self, tokenizer: Tokenizer, skip: bool) -> None:
        self._tokenizer, self._skip = tokenizer, skip
        if hasattr(tokenizer, "decode_bytes"):
            self.decode_bytes = tokenizer.decode_bytes

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
