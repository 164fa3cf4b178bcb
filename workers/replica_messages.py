"""Every message across the replica-actor boundary (front doors and the controller <-> a replica).

    front door --GenerateMsg-->          replica: one request (its `SamplingParams`, its block hashes)
               <--RequestOutput...--     the engine's outputs since the previous item, merged
                                         (`merge_outputs`: `token_ids` left empty, never all ids
                                         so far: linear, not quadratic, in the output length),
                                         the last one finished
    controller --describe()-->           <--ReplicaInfoMsg
    tests, tools --work_counts()-->      <--WorkCountsMsg
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.block_hash import BlockHash
from cache_service.link_costs import PageBytes
from workers.engine.request import RequestOutput
from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.model.forward_batch import ForwardCounts


@dataclass(frozen=True)
class GenerateMsg:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None
    block_hashes: tuple[BlockHash, ...] | None = None  # the prompt's, hashed once by the front door (None: hash here)
    # prefill/decode disaggregation: stop after the first token and hold the request for a hand-off
    # (`HandoffMixin`); the stream then ends after that token without a finished output
    hand_off: bool = False


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one stream item: their `new_token_ids` (and logprobs)
    joined, the rest from the last. `token_ids` is left empty: the caller holds the tokens sent
    before (linear, not quadratic, in the output length) and fills it in."""
    last = outputs[-1]
    new = tuple(t for out in outputs for t in out.new_token_ids)
    logprobs = None
    if any(out.logprobs is not None for out in outputs):
        logprobs = tuple(lp for out in outputs for lp in (out.logprobs or ()))
    return dataclasses.replace(last, new_token_ids=new, token_ids=(), logprobs=logprobs)


@dataclass(frozen=True)
class HandoffSentMsg:
    """A replica's answer to `send_handoff`: whether the decoder took the request; if not, this
    replica kept it (`hand_off_or_keep`) and streams it from `resume_stream`, and `reason` says why."""

    request_id: str
    delivered: bool
    num_bytes: int = 0  # crossed the channel
    reason: str | None = None
    num_skipped_bytes: int = 0  # the package's rows the decoder already held (not sent)


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
    # what a transfer of its hits moves (`workers.transfer.page_bytes`); None: its pages cannot move (TP > 1)
    page_bytes: PageBytes | None = None
