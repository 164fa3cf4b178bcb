"""Routing by estimated cost: the prefill of the tokens each replica would *really* recompute
(the reconciled hybrid hit, with the coordinator's semantics) plus its load.

Policies, for comparison:
    hybrid             cost = prefill(N - reconciled hit on r) + load(r); may plan a transfer
    attention_overlap  like routers built for dense models: counts matched attention blocks
                       only, blind to where Mamba snapshots live
    round_robin, random
Every replica is scored in one pass over the prompt's chain (`scorer.AllReplicaScorer`): a
decision costs O(blocks + replicas), not a coordinator run per replica. Equal costs prefer the
replica holding more of the prompt's attention KV, then the less loaded one, then a random one
(an idle cluster spreads requests instead of sending all of them to the first replica).
A transfer competes when the best holder is busy: a less-loaded replica receives the holder's
KV pages and Mamba page for the hit, then serves a normal local hit.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from cache_service.block_hash import BlockHash
from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.messages import ReplicaEstimate, RouteDecision, TransferPlan
from cache_service.scorer import AllReplicaScorer


class RoutingPolicy(str, Enum):
    HYBRID = "hybrid"
    ATTENTION_OVERLAP = "attention_overlap"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


@dataclass(frozen=True)
class RouterConfig:
    prefill_cost_per_token: float = 1.0  # relative units; only ratios matter
    load_cost_per_queued_token: float = 1.0
    transfer_cost_per_token: float = 0.05  # moving a token's pages vs recomputing it
    min_transfer_tokens: int = 256


class NoReplicaError(RuntimeError):
    """No routable replica (none registered, or all stale/dead)."""


class Router:
    def __init__(self, index: GlobalIndex, coordinator: HybridCoordinator, policy: RoutingPolicy | str,
                 config: RouterConfig | None = None, seed: int = 0) -> None:
        self.index = index
        self.coordinator = coordinator
        self.policy = RoutingPolicy(policy)
        self.config = config or RouterConfig()
        self._rr = itertools.count()
        self._rng = random.Random(seed)
        self.scorer = AllReplicaScorer(coordinator)

    def route(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
              queued_tokens: Mapping[str, int] | None = None) -> RouteDecision:
        """`queued_tokens`: the candidate replicas and their load (default: every indexed replica,
        idle). Candidates the index cannot vouch for (stale, unknown) count as hitting nothing."""
        load = dict(queued_tokens) if queued_tokens is not None else dict.fromkeys(self.index.replicas, 0)
        replicas = sorted(load)
        if not replicas:
            raise NoReplicaError("no routable replica")
        policy = self.policy.value
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return RouteDecision(replicas[next(self._rr) % len(replicas)], policy, 0, ())
        if self.policy is RoutingPolicy.RANDOM:
            return RouteDecision(self._rng.choice(replicas), policy, 0, ())
        states, everyone = self.index.replicas, 0
        for r in replicas:
            s = states.get(r)
            if s is not None and not s.stale:
                everyone |= 1 << s.bit
        hits: dict[str, int] = {}
        attention: dict[str, int] = {}
        if everyone:
            scores = self.scorer.score(hashes, num_prompt_tokens, self.index.holders, everyone)
            by_bit = self.index.by_bit
            attention = {by_bit[b]: v for b, v in scores.attention_tokens.items()}
            hits = attention if self.policy is RoutingPolicy.ATTENTION_OVERLAP else {
                by_bit[b]: v for b, v in scores.hit_tokens.items()}
        best_key, best = None, []
        for r in replicas:
            cost = self._cost(num_prompt_tokens, hits.get(r, 0), load[r])
            key = (cost, -attention.get(r, 0), load[r])
            if best_key is None or key < best_key:
                best_key, best = key, [r]
            elif key == best_key:
                best.append(r)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        estimate = {r: ReplicaEstimate(r, hits.get(r, 0), self._cost(num_prompt_tokens, hits.get(r, 0), load[r]),
                                       attention.get(r, 0))
                    for r in sorted({chosen, *hits, *attention})}
        decision = RouteDecision(chosen, policy, hits.get(chosen, 0), tuple(estimate.values()), load_only=not everyone)
        if self.policy is RoutingPolicy.HYBRID and hits:
            decision = self._maybe_transfer(decision, num_prompt_tokens, load, best_key[0])
        return decision

    def _cost(self, num_prompt_tokens: int, hit: int, load: int) -> float:
        c = self.config
        return (num_prompt_tokens - hit) * c.prefill_cost_per_token + load * c.load_cost_per_queued_token

    def _maybe_transfer(self, decision: RouteDecision, num_prompt_tokens: int, load: Mapping[str, int],
                        best_cost: float) -> RouteDecision:
        c = self.config
        holder = max(decision.estimates, key=lambda e: (e.hit_tokens, -e.cost))
        if holder.hit_tokens < c.min_transfer_tokens:
            return decision
        hit = {e.replica_id: e.hit_tokens for e in decision.estimates}
        dst = min((r for r in load if r != holder.replica_id and hit.get(r, 0) < holder.hit_tokens),
                  key=lambda r: (load[r], r), default=None)
        if dst is None:
            return decision
        cost = (self._cost(num_prompt_tokens, holder.hit_tokens, load[dst])
                + holder.hit_tokens * c.transfer_cost_per_token)
        if cost >= best_cost:
            return decision
        plan = TransferPlan(holder.replica_id, dst, holder.hit_tokens)
        estimates = decision.estimates
        if dst not in hit:
            estimates = (*estimates, ReplicaEstimate(dst, 0, self._cost(num_prompt_tokens, 0, load[dst])))
        return RouteDecision(dst, decision.policy, holder.hit_tokens, estimates, plan)
