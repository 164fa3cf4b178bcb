"""Where a prefilled request decodes (prefill/decode disaggregation, issue 31): the decode replica
that costs least to hand it to and to run it on.

A hand-off sends the decoder every page of the prompt it does not hold (`workers.handoff_transfer`:
the decoder answers with the rows it has), so holding part of the prefix saves bytes on the link,
not prefill work. What counts is the KV the decoder holds, Mamba state or not: the package brings
the working state at the prompt's end (`handoff_import.reserve_import`). The cost of decoder d, in
the router's units (a prefill token = `prefill_cost_per_token`):

    cost(d) = transfer_cost_per_token x (N - held(d))  +  load_cost_per_queued_token x load(d)

N the prompt's tokens, held(d) the attention match the index credits d with (at least its
reconciled hit: the same scoring pass as routing a prefill), load(d) d's
queued tokens (its reports plus what was placed on it since: mostly output tokens still to
decode). Memory headroom: a decoder whose last report shows too few free attention blocks for the
part it lacks plus the output (`free_blocks x block_tokens < N - held + max_tokens`) is passed over
while another has room; if none has, the cheapest is chosen anyway (its import refuses if it truly
has no room, and the prefill replica then decodes the request itself: nothing is lost). A decoder
that has not reported yet is taken to have room. Ties: the more held, then the id.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from cache_service.messages import ReplicaEstimate, RouteDecision
from cache_service.router import MAX_ESTIMATES, NoReplicaError, ReplicaHits, RouterConfig

POLICY = "decode_handoff"


def place_decoder(config: RouterConfig, scored: ReplicaHits, num_prompt_tokens: int, num_output_tokens: int,
                  loads: Mapping[str, int], free_tokens: Mapping[str, int | None],
                  candidates: Collection[str]) -> RouteDecision:
    """The decoder for one hand-off (module docstring); its `expected_hit_tokens` and estimates
    are tokens held (KV). `free_tokens[d]`: d's free attention
    blocks in tokens at its last report (None or absent: not reported yet). Raises
    `NoReplicaError` without candidates."""
    if not candidates:
        raise NoReplicaError("no decode replica")
    held = {d: max(scored.hit_tokens.get(d, 0), scored.attention_tokens.get(d, 0)) for d in candidates}

    def cost(d: str) -> float:
        return (config.transfer_cost_per_token * (num_prompt_tokens - held[d])
                + config.load_cost_per_queued_token * loads.get(d, 0))

    def has_room(d: str) -> bool:
        free = free_tokens.get(d)
        return free is None or free >= num_prompt_tokens - held[d] + num_output_tokens

    roomy = [d for d in candidates if has_room(d)] or list(candidates)
    chosen = min(roomy, key=lambda d: (cost(d), -held[d], d))
    holders = sorted((d for d in candidates if held[d]), key=lambda d: (-held[d], d))[:MAX_ESTIMATES]
    estimates = tuple(ReplicaEstimate(d, held[d], cost(d), scored.attention_tokens.get(d, 0))
                      for d in sorted({chosen, *holders}))
    return RouteDecision(chosen, POLICY, held[chosen], estimates, load_only=not scored.any_vouched)
