"""Prefill/decode disaggregation in the simulation (`--pd-split P:D`, issue 31): which replicas
prefill and which decode, what a hand-off moves, and where it goes.

    replicas   0 .. P-1 prefill (the routing policy chooses among them only), P .. R-1 decode
    hand-off   when a prefill ends, its request's prompt KV pages, its Mamba state (one page per
               state group) and, with MTP, its draft KV pages move to a decode replica:
                   bytes = sum over attention groups of (pages of the prompt - pages the decode
                           replica already holds) x page bytes  +  sum of state page bytes
                   time  = bytes / transfer_bytes_per_s   (asynchronous: the prefill replica
                           goes on with its next prefill)
    choice     the serving path's placement (`cache_service.decode_placement`, the same function):
               transfer_cost_per_token x (pages it lacks, in tokens: its attention match on the
               global index) + load_cost_per_queued_token x its queued decode tokens (streams
               decoding or on their way); every decoder has room (no memory model here)
    TTFT       the prefill's last step samples the first token, delivered with the stream from the
               decode replica once the hand-off lands (as vLLM's disaggregated proxy and Dynamo
               serve a client from the decode worker): TTFT = prefill end + hand-off time, and
               the records keep `handoff_s` apart for the other convention (TTFT at prefill end,
               the hand-off in the second token's gap)

The decode replica publishes what it received (the prompt's blocks and its final state, through
the same group managers) to the index when the hand-off lands, so its next hand-off of a shared
prefix moves less. A request of one output token needs no decode and is not handed off.
(Sliding-window groups would need only their window's pages; every page counts here, an upper
bound; no shipped layout has one.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.block_hash import BlockHash
from cache_service.decode_placement import place_decoder
from cache_service.global_index import GlobalIndex
from cache_service.router import ReplicaHits, RouterConfig
from cache_service.scorer import AllReplicaScorer
from cache_service.trace_sim.config import SimLayout
from cache_service.trace_sim.step_timeline import StepTimeline


@dataclass(frozen=True)
class PdSplit:
    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"--pd-split needs at least one prefill and one decode replica, got {self}")

    @classmethod
    def parse(cls, text: str) -> PdSplit:
        try:
            p, d = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--pd-split must be P:D (two integers), got {text!r}") from None
        return cls(p, d)

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode

    def __str__(self) -> str:
        return f"{self.num_prefill}:{self.num_decode}"


def handoff_bytes(layout: SimLayout, num_tokens: int, num_held_tokens: int = 0) -> int:
    """Bytes a hand-off of a `num_tokens` prompt moves to a replica already holding the KV of its
    first `num_held_tokens` (whole blocks; the partial last block moves): see the module doc."""
    held = min(num_held_tokens, num_tokens)
    total = 0
    for group, page in zip(layout.layout.groups, layout.page_bytes):
        if group.is_attention:
            total += (math.ceil(num_tokens / group.block_size) - held // group.block_size) * page
        else:
            total += page
    return total


class DecodePicker:
    """Chooses the decode replica of each hand-off (the module doc's choice)."""

    def __init__(self, scorer: AllReplicaScorer, index: GlobalIndex, replica_ids: Sequence[str],
                 decode_positions: Sequence[int], router: RouterConfig | None = None) -> None:
        self.scorer = scorer
        self.index = index
        self.router = router or RouterConfig()
        self.decode_positions = list(decode_positions)
        self._ids = [replica_ids[i] for i in self.decode_positions]
        self._position = {replica_ids[i]: i for i in decode_positions}
        self._mask = index.mask_of(self._ids)

    def pick(self, hashes: Sequence[BlockHash], num_tokens: int, timelines: Sequence[StepTimeline],
             at: float) -> tuple[int, int]:
        """(decode replica, tokens of the prompt whose KV it holds) for a hand-off leaving at `at`."""
        for i in self.decode_positions:
            timelines[i].advance(at)
        scores = self.scorer.score(hashes, num_tokens, self.index.holders, self._mask)
        by_bit = self.index.by_bit
        scored = ReplicaHits({by_bit[b]: v for b, v in scores.hit_tokens.items()},
                             {by_bit[b]: v for b, v in scores.attention_tokens.items()}, True)
        loads = {r: timelines[self._position[r]].queued_tokens(at) for r in self._ids}
        decision = place_decoder(self.router, scored, num_tokens, 0, loads, {}, self._ids)
        return self._position[decision.replica_id], decision.expected_hit_tokens
