"""Every message across the replica-actor boundary (front doors and the controller <-> a replica).

    front door --GenerateMsg-->          replica: one request
               <--TokenDeltaMsg...--     the tokens produced since the previous item (a batch of
                                         engine outputs, never all ids so far: linear, not
                                         quadratic, in the output length), the last one finished
    controller --describe()-->           <--ReplicaInfoMsg
    tests, tools --work_counts()-->      <--WorkCountsMsg
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.model.forward_batch import ForwardCounts


@dataclass(frozen=True)
class GenerateMsg:
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    request_id: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    @classmethod
    def of(cls, prompt_token_ids, params, cache_salt: str | None = None, request_id: str | None = None):
        return cls(list(prompt_token_ids), params.max_tokens, params.temperature, params.top_p, params.top_k,
                   params.seed, tuple(params.stop_token_ids), params.ignore_eos, cache_salt, request_id,
                   params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                   params.min_tokens, params.logprobs)

    def sampling_params(self):
        from workers.engine.sampling import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens, logprobs=self.logprobs)


@dataclass(frozen=True)
class TokenDeltaMsg:
    """Engine outputs merged: `new_token_ids` follow the `num_tokens_before` tokens already sent."""

    request_id: str
    num_tokens_before: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    num_draft_proposed: int
    num_draft_accepted: int
    logprobs: tuple | None = None  # one `TokenLogprobs` per new token, when the request asked
    num_computed_prompt_tokens: int = 0  # prompt tokens this replica ran through its model's forward
    num_preemptions: int = 0  # times the replica's engine preempted the request so far

    @classmethod
    def merge(cls, outputs: list, num_tokens_before: int) -> TokenDeltaMsg:
        """One delta for consecutive `RequestOutput`s of one request."""
        last = outputs[-1]
        new = tuple(t for out in outputs for t in out.new_token_ids)
        logprobs = None
        if any(out.logprobs is not None for out in outputs):
            logprobs = tuple(lp for out in outputs for lp in (out.logprobs or ()))
        return cls(last.request_id, num_tokens_before, new, last.finished, last.finish_reason,
                   last.num_prompt_tokens, last.num_cached_tokens, last.ttft_s, last.num_draft_proposed,
                   last.num_draft_accepted, logprobs, last.num_computed_prompt_tokens, last.num_preemptions)


@dataclass(frozen=True)
class WorkCountsMsg:
    """The prefill work a replica did: prompt tokens its engine sent through the model's forward (all
    requests), and what each TP rank's shard ran (`workers.model.forward_batch.ForwardCounts`, by rank)."""

    num_computed_prompt_tokens: int
    ranks: tuple[ForwardCounts, ...]


@dataclass(frozen=True)
class ReplicaInfoMsg:
    replica_id: str
    groups: tuple[str, ...]
    eagle: str
    fingerprint: str
    vocab_size: int
    max_model_len: int
    alignment: int
    hash_block_size: int
    node_id: str
    node_ip: str
    pid: int
    tp_size: int
