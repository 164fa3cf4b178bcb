"""The sampler (its parameters: `workers.engine.sampling_params`): greedy at temperature 0, else
temperature / top-k / top-p with a per-request seeded generator; repetition, presence and
frequency penalties and `min_tokens` applied to the logits first (as vLLM does); optional
logprobs of the chosen token and the top alternatives, taken from the model's raw distribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from workers.engine.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """The chosen token's log-probability and the `top` (token id, logprob) pairs, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


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

    @property
    def seed(self) -> int | None:
        """The seed this sampler's generator is made from (None: greedy)."""
        return self._seed

    def state(self) -> tuple[int | None, torch.Tensor | None]:
        """(seed, the generator's state or None before the first sample): what `restore` takes
        to continue the same random stream elsewhere (a prefill -> decode hand-off)."""
        return self._seed, self.generator.get_state().clone() if self.generator is not None else None

    def restore(self, seed: int | None, state: torch.Tensor | None, device: str | torch.device) -> None:
        """Continue the stream `state()` gave (its generator on `device`)."""
        self._seed = seed
        self.generator = None
        if state is not None:
            self.generator = torch.Generator(device)
            self.generator.set_state(state)

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
