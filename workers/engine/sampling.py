"""Sampling parameters (validated) and the sampler: greedy at temperature 0, else
temperature / top-k / top-p with a per-request seeded generator; repetition, presence and
frequency penalties and `min_tokens` applied to the logits first (as vLLM does); optional
logprobs of the chosen token and the top alternatives, taken from the model's raw distribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


class TokenLogprobs(NamedTuple):
    """The chosen token's log-probability and the `top` (token id, logprob) pairs, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def _number(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo < value if lo_open else lo <= value) and value <= hi):
        raise InvalidRequestError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """`presence_penalty` / `frequency_penalty` (OpenAI, on the output tokens so far) and
    `repetition_penalty` (HF / vLLM, on prompt and output tokens; 1 = off); `min_tokens`: stop
    tokens (EOS included) cannot be sampled before this many outputs; `logprobs`: None = none,
    k >= 0 = the chosen token's logprob plus the top k."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _number("temperature", self.temperature, 0.0, 100.0)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 2.0**31, lo_open=True)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes the logits (penalties, min_tokens):
        then the sampled token is not the raw argmax, so speculative verification cannot be used."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)


class Sampler:
    """Samples one token from a row of logits. Greedy rows without penalties are plain argmax."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        """`eos_token_ids`: the model's end-of-sequence ids (none when the request ignores eos);
        with `min_tokens` they are banned, with the request's stop ids, until enough tokens exist.
        `is_argmax`: `sample` would return `int(torch.argmax(logits))` (greedy, nothing shaping the
        logits), so a caller holding a batch's argmax may take the token from it."""
        self.params = params
        self.generator: torch.Generator | None = None
        self.min_tokens_banned = tuple(sorted(set(params.stop_token_ids) | set(eos_token_ids)))
        self.stop_token_ids = frozenset(self.min_tokens_banned)  # a sampled one finishes the request
        # the token is the raw row's first argmax: the engine reads it from the step's batched argmax
        self.is_argmax = params.greedy and not params.shapes_logits
        # the seed is drawn now; the generator is made on the logits' device at the first sample
        # (torch.multinomial takes a generator of its own device only)
        self._seed = None if params.greedy else (params.seed if params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()) -> int:
        """`logits`: [vocab] float32; `prompt_ids` / `output_ids`: the request's tokens so far
        (read only when a penalty or `min_tokens` is set)."""
        return int(self.sample_on_device(logits, prompt_ids, output_ids))

    def sample_on_device(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (),
                         output_ids: Sequence[int] = ()) -> torch.Tensor:
        """`sample` without reading the result: int64 [1] on the logits' device (no host sync)."""
        p = self.params
        if p.shapes_logits:
            logits = self.shape(logits, prompt_ids, output_ids)
        if p.greedy:
            return torch.argmax(logits).view(1)
        scaled = _finite(logits / p.temperature)
        if p.top_k and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            keep[0] = True  # a top_p below float32's smallest value still keeps the best token
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if self.generator is None:
            self.generator = torch.Generator(probs.device).manual_seed(self._seed)
        return torch.multinomial(probs, 1, generator=self.generator)

    def shape(self, logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
        """Penalties and the min_tokens ban, on a copy of `logits`."""
        p = self.params
        logits = logits.clone()
        vocab = logits.numel()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[seen]
                logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids:
            counts = Counter(t for t in output_ids if t < vocab)
            ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
            n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
            logits[ids] -= p.frequency_penalty * n + p.presence_penalty
        if len(output_ids) < p.min_tokens and self.min_tokens_banned:
            banned = [t for t in self.min_tokens_banned if t < vocab]
            logits[banned] = float("-inf")
        return _finite(logits)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Extreme (but valid) temperatures and penalties overflow to +inf, which softmax turns into
    NaN; the largest finite value keeps the intended ranking."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """The raw model distribution's logprob of `token` and its `num_top` best tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logp, min(num_top, logp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(logp[token]), top)
