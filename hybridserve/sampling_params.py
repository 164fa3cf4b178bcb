"""`SamplingParams` as vLLM users write them (text `stop` strings, `skip_special_tokens`, ...),
turned into the engine's token-level `workers.engine.sampling.SamplingParams`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.sampling import SamplingParams as EngineSamplingParams


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and defaults (temperature 1.0: pass 0 for greedy). `n` > 1 is refused."""

    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
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
            raise ValueError(f"n={self.n}: only n=1 is supported; repeat the prompt instead")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_engine(self, max_tokens: int, eos_token_ids: Sequence[int]) -> EngineSamplingParams:
        """Raises `workers.engine.errors.InvalidRequestError` for bad values."""
        stops = list(self.stop_token_ids or [])
        if not self.ignore_eos:
            stops += [t for t in eos_token_ids if t not in stops]
        return EngineSamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
            seed=self.seed, stop_token_ids=tuple(stops), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, logprobs=self.logprobs)
