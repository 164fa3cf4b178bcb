"""One request's state inside the engine, and what the engine reports back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from cache_service.block_hash import RequestBlockHashes
from cache_service.miss_reasons import LookupReport
from workers.engine.sampling import Sampler, TokenLogprobs
from workers.engine.sampling_params import SamplingParams


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    HANDOFF = "handoff"  # handed to another engine, which finishes it (`handoff.py`); kept as a finish


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hashes: RequestBlockHashes
    cache_salt: str | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs is set
    # what the caches hold for this request (its pages themselves live in the group managers)
    num_computed_tokens: int = 0  # target KV + Mamba state valid for [0, n)
    num_draft_computed_tokens: int = 0  # draft KV valid (true inputs) for [0, n)
    num_cached_tokens: int = 0  # the prefix hit at the first admission (what the client is told)
    num_restored_tokens: int = 0  # the prefix hit at the latest admission (differs after a preemption)
    # of num_cached_tokens: those whose hit copied some page back from the host tier (0: all on the device)
    num_host_cached_tokens: int = 0
    cache_report: LookupReport | None = None  # the first admission's lookup and its miss reason
    num_prefill_tokens: int = 0  # prefill runs to here: the prompt, or every known token after a preemption
    # prompt tokens sent through the target model's forward (prefill chunks; a recomputation after
    # preemption counts again): the work a hit saved is num_prompt_tokens - this
    num_computed_prompt_tokens: int = 0
    checkpoints: tuple[int, ...] = ()  # planned Mamba snapshot positions
    periodic_checkpoints: frozenset[int] = frozenset()  # of those, retention grid positions only
    junctions: tuple[int, ...] = ()
    # drafts to verify at the next decode: `num_draft_tokens` of them; their values are in draft_token_ids,
    # or still on the device (drafter.PendingDrafts) while draft_token_ids is empty
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    sampler: Sampler | None = None
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.num_prefill_tokens = self.num_prefill_tokens or len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def has_pending_drafts(self) -> bool:
        """Drafts proposed whose values the host has not read yet (they are in drafter.PendingDrafts)."""
        return self.num_draft_tokens > len(self.draft_token_ids)

    def set_drafts(self, draft_token_ids: list[int]) -> None:
        self.draft_token_ids = draft_token_ids
        self.num_draft_tokens = len(draft_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    num_draft_proposed: int
    num_draft_accepted: int
    logprobs: tuple[TokenLogprobs, ...] | None = None  # of `new_token_ids`, when the request asked
    num_computed_prompt_tokens: int = 0  # prompt tokens run through the model's forward (Request's field)
    num_preemptions: int = 0  # times the engine gave its pages back and recomputed it
    # the first admission's lookup (`cache_service.miss_reasons`): what `explain` shows for this request
    cache_report: LookupReport | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens: a hit that promoted pages from the host tier

    @classmethod
    def of(cls, req: Request, new_token_ids: list[int]) -> RequestOutput:
        return cls(
            req.request_id, tuple(new_token_ids), tuple(req.output_token_ids), req.status is RequestStatus.FINISHED,
            req.finish_reason.value if req.finish_reason else None, req.num_prompt_tokens, req.num_cached_tokens,
            req.ttft_s, req.num_draft_proposed, req.num_draft_accepted,
            tuple(req.output_logprobs[len(req.output_logprobs) - len(new_token_ids):])
            if req.params.logprobs is not None else None,
            req.num_computed_prompt_tokens,
            req.num_preemptions,
            req.cache_report,
            req.num_host_cached_tokens,
        )
