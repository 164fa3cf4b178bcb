"""Routing by estimated cost: the prefill of the tokens each replica would *really* recompute
(the reconciled hybrid hit, computed by the same coordinator the workers use) plus its load.

Policies, for comparison:
    hybrid             cost = prefill(N - reconciled hit on r) + load(r); may plan a transfer
    attention_overlap  like routers built for dense models: counts matched attention blocks
                       only, blind to where Mamba snapshots live
    round_robin, random
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


@dataclass(frozen=True)
class ReplicaEstimate:
    replica_id: str
    hit_tokens: int  # what this policy believes the replica would hit
    cost: float
    attention_tokens: int = 0  # matched attention blocks there (tokens): the tie-break


@dataclass(frozen=True)
class TransferPlan:
    src_replica: str
    dst_replica: str
    num_tokens: int


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    policy: RoutingPolicy
    expected_hit_tokens: int
    estimates: tuple[ReplicaEstimate, ...]
    transfer: TransferPlan | None = None


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

    def _hit(self, replica_id: str, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> tuple[int, int]:
        """(the hit this policy believes in, the attention match) on `replica_id`."""
        result = self.coordinator.find_longest_hit(hashes, num_prompt_tokens, self.index.view(replica_id), False)
        if self.policy is RoutingPolicy.ATTENTION_OVERLAP:
            return result.attention_match_tokens, result.attention_match_tokens
        return result.hit_tokens, result.attention_match_tokens

    def route(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
              queued_tokens: Mapping[str, int] | None = None) -> RouteDecision:
        replicas = sorted(r for r in self.index.routable_replicas() if queued_tokens is None or r in queued_tokens)
        if not replicas:
            raise NoReplicaError("no routable replica")
        load = queued_tokens or {}
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return RouteDecision(replicas[next(self._rr) % len(replicas)], self.policy, 0, ())
        if self.policy is RoutingPolicy.RANDOM:
            return RouteDecision(self._rng.choice(replicas), self.policy, 0, ())
        c = self.config
        estimates = []
        for r in replicas:
            hit, attention = self._hit(r, hashes, num_prompt_tokens)
            cost = (num_prompt_tokens - hit) * c.prefill_cost_per_token + load.get(r, 0) * c.load_cost_per_queued_token
            estimates.append(ReplicaEstimate(r, hit, cost, attention))
        # equal cost: prefer the replica holding more of the prompt's attention KV; it is where a
        # shared-prefix junction gets its Mamba snapshot (the next request there then hits)
        best = min(estimates, key=lambda e: (e.cost, -e.attention_tokens, e.replica_id))
        decision = RouteDecision(best.replica_id, self.policy, best.hit_tokens, tuple(estimates))
        if self.policy is RoutingPolicy.HYBRID:
            decision = self._maybe_transfer(decision, num_prompt_tokens, load)
        return decision

    def _maybe_transfer(
        self, decision: RouteDecision, num_prompt_tokens: int, load: Mapping[str, int]
    ) -> RouteDecision:
        c = self.config
        holder = max(decision.estimates, key=lambda e: (e.hit_tokens, -e.cost))
        if holder.hit_tokens < c.min_transfer_tokens:
            return decision
        best_cost = min(e.cost for e in decision.estimates)
        for dst in sorted(decision.estimates, key=lambda e: load.get(e.replica_id, 0)):
            if dst.replica_id == holder.replica_id or dst.hit_tokens >= holder.hit_tokens:
                continue
            cost = ((num_prompt_tokens - holder.hit_tokens) * c.prefill_cost_per_token
                    + load.get(dst.replica_id, 0) * c.load_cost_per_queued_token
                    + holder.hit_tokens * c.transfer_cost_per_token)
            if cost < best_cost:
                plan = TransferPlan(holder.replica_id, dst.replica_id, holder.hit_tokens)
                return RouteDecision(dst.replica_id, self.policy, holder.hit_tokens, decision.estimates, plan)
        return decision
