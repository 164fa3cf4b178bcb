"""What `LLM.generate` / `LLM.chat` return: vLLM's `RequestOutput` / `CompletionOutput` shape."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.sampling import TokenLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob}, the chosen token first
    cumulative_logprob: float | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool = True
    num_computed_prompt_tokens: int = 0  # prompt tokens run through the model's forward


def logprob_dicts(logprobs: list[TokenLogprobs] | None, token_ids: list[int]) -> list[dict[int, float]] | None:
    if logprobs is None:
        return None
    return [{t: lp.logprob, **{i: v for i, v in lp.top if i != t}} for t, lp in zip(token_ids, logprobs)]
