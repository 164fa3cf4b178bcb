"""`SamplingParams`: the one type for how a request is sampled and when it stops, from the
user's `LLM.generate` and the HTTP body through `GenerateMsg` to the engine's sampler.

vLLM's names and defaults: temperature 1.0 (pass 0 for greedy), top_k 0 or -1 off, `max_tokens`
None meaning "up to max_model_len". The engine reads the token-level fields; the text layer
(detokenizer, `CompletionState`) reads `stop`, `include_stop_str_in_output` and
`skip_special_tokens`. Bad values raise `InvalidRequestError` (a `ValueError`) when the object
is built, so a bad request is refused before it reaches a queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from workers.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


def _number(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo < value if lo_open else lo <= value) and value <= hi):
        raise InvalidRequestError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")


def _integer(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidRequestError(f"{name} must be an integer {bound}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """`presence_penalty` / `frequency_penalty` (OpenAI, on the output tokens so far) and
    `repetition_penalty` (HF / vLLM, on prompt and output tokens; 1 = off); `min_tokens`: stop
    tokens (EOS included) cannot be sampled before this many outputs; `logprobs`: None = none,
    k >= 0 = the chosen token's logprob plus the top k; `stop`: strings matched on the text
    (normalised to a tuple); `n` > 1 is refused (repeat the prompt instead)."""

    max_tokens: int | None = 16  # None: up to max_model_len (the engine resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (normalised to 0)
    seed: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if self.n != 1:
            raise InvalidRequestError(f"n={self.n}: only n=1 is supported; repeat the prompt instead")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0.0, 100.0)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _integer("top_k", self.top_k, -1)
        object.__setattr__(self, "top_k", max(0, self.top_k))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) for s in stops):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stops)
        ids = tuple(self.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 2.0**31, lo_open=True)
        if self.max_tokens is None:
            _integer("min_tokens", self.min_tokens, 0)
        else:
            _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes the logits (penalties, min_tokens):
        then the sampled token is not the raw argmax, so speculative verification cannot be used."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)

    def stopping_at(self, eos_token_ids: Iterable[int]) -> SamplingParams:
        """These params with the model's EOS ids added to `stop_token_ids` (none with
        `ignore_eos`): how a front end hands the text model's EOS list (generation_config.json)
        to the engine, whose own EOS ids come from config.json."""
        if self.ignore_eos:
            return self
        extra = tuple(t for t in dict.fromkeys(eos_token_ids) if t not in self.stop_token_ids)
        return replace(self, stop_token_ids=self.stop_token_ids + extra) if extra else self

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These params with `max_tokens` resolved (min_tokens clamped to it, as vLLM caps it)."""
        return replace(self, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens))
