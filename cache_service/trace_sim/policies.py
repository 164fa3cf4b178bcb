"""Routing policies of the simulation. `hybrid`, `attention_overlap` and `round_robin` are the
real `Router` over the real `GlobalIndex`; the others are defined here on the same index views:

    power_of_two               two replicas drawn at random (seeded), the less loaded one
    ray_serve_prefix_affinity  Ray Serve LLM's PrefixCacheAffinityRouter as documented: if the
                               in-flight request counts differ by more than `imbalanced_threshold`
                               (10) go least loaded; else the highest prefix match if its match
                               rate is >= `match_rate_threshold` (0.1); else least loaded. Its
                               prefix tree matches prompt text, i.e. attention overlap here.
    oracle                     one cache with the memory of all replicas (no routing question);
                               compute goes to the least-loaded replica
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.block_hash import BlockHash
from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.messages import HostCopyPrice
from cache_service.router import Router, RouterConfig, RoutingPolicy
from cache_service.scorer import AllReplicaScorer
from cache_service.trace_sim.prefill_queue import PrefillQueue

POLICY_NAMES = (
    "hybrid", "attention_overlap", "round_robin", "power_of_two", "ray_serve_prefix_affinity", "oracle",
)


@dataclass(frozen=True)
class Choice:
    replica: int
    transfer_src: int | None = None  # a transfer planned by the hybrid router
    transfer_tokens: int = 0


class SimPolicy(ABC):
    name: str
    shared_cache = False

    def __init__(self, index: GlobalIndex, coordinator: HybridCoordinator, replica_ids: Sequence[str],
                 tokens_per_s: float, seed: int = 0, router: RouterConfig | None = None,
                 host_price: HostCopyPrice | None = None) -> None:
        """`host_price`: what each replica would report for a host hit (`messages.HostCopyPrice`, from
        the cost model's copy and prefill speeds); None: no host tier."""
        self.index = index
        self.host_prices = {r: host_price for r in replica_ids} if host_price is not None else None
        self.router_config = router or RouterConfig()
        self.coordinator = coordinator
        self.replica_ids = list(replica_ids)
        self.position = {r: i for i, r in enumerate(self.replica_ids)}
        self.tokens_per_s = tokens_per_s
        self.seed = seed  # the router's tie-breaks (RouterPolicy), power_of_two's draws
        self.rng = random.Random(seed)
        # room(r): the tokens of KV replica r takes without evicting, as its load report says
        # (`LoadReportMsg.num_empty_blocks`); set by the simulation once its replicas exist
        self.room: Callable[[str], int | None] | None = None

    def queued_tokens(self, queues: Sequence[PrefillQueue], now: float) -> dict[str, int]:
        """The load the cache service's router sees: each replica's reported queued tokens."""
        return {r: q.queued_tokens(now) for r, q in zip(self.replica_ids, queues)}

    @staticmethod
    def least_loaded(queues: Sequence[PrefillQueue], now: float, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda i: (queues[i].queued_tokens(now), i))

    @abstractmethod
    def choose(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
               queues: Sequence[PrefillQueue], now: float) -> Choice: ...


class RouterPolicy(SimPolicy):
    """The cluster's own Router, and what the front door does with its decision
    (`cluster.control.transfers.plan_transfer`): move the pages of the service's transfer plan, or else of
    the replica that hits more than the chosen one (the router may pick another replica for its
    load or for a junction), before serving there."""

    def __init__(self, *args, policy: RoutingPolicy, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = policy.value
        self.router = Router(self.index, self.coordinator, policy, self.router_config, seed=self.seed)

    def choose(self, hashes, num_prompt_tokens, queues, now) -> Choice:
        decision = self.router.route(hashes, num_prompt_tokens, self.queued_tokens(queues, now),
                                     host_prices=self.host_prices, room=self.room)
        plan = decision.transfer
        if plan is not None:
            return Choice(self.position[plan.dst_replica], self.position[plan.src_replica], plan.num_tokens)
        target = decision.replica_id
        holder = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
        if holder is not None and holder.replica_id != target and holder.hit_tokens > decision.hit_on(target):
            return Choice(self.position[target], self.position[holder.replica_id], holder.hit_tokens)
        return Choice(self.position[target])


class PowerOfTwo(SimPolicy):
    name = "power_of_two"

    def choose(self, hashes, num_prompt_tokens, queues, now) -> Choice:
        n = len(queues)
        pair = self.rng.sample(range(n), 2) if n > 1 else [0]
        return Choice(self.least_loaded(queues, now, pair))


class RayServePrefixAffinity(SimPolicy):
    """Matches come from the one-pass scorer (each replica's attention match, as the coordinator
    computes it per replica; `tests/cache_service/test_scorer.py`)."""

    name = "ray_serve_prefix_affinity"
    imbalanced_threshold = 10
    match_rate_threshold = 0.1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = AllReplicaScorer(self.coordinator)

    def choose(self, hashes, num_prompt_tokens, queues, now) -> Choice:
        everyone = range(len(queues))
        counts = [q.num_in_flight(now) for q in queues]
        if max(counts) - min(counts) > self.imbalanced_threshold:
            return Choice(min(everyone, key=lambda i: (counts[i], i)))
        scores = self.scorer.score(hashes, num_prompt_tokens, self.index.holders, self.index.routable_mask())
        matches = [0] * len(queues)
        for bit, tokens in scores.attention_tokens.items():
            matches[self.position[self.index.by_bit[bit]]] = tokens
        best = max(matches)
        if best and best / num_prompt_tokens >= self.match_rate_threshold:
            return Choice(min((i for i in everyone if matches[i] == best), key=lambda i: (counts[i], i)))
        return Choice(min(everyone, key=lambda i: (counts[i], i)))


class Oracle(SimPolicy):
    name = "oracle"
    shared_cache = True

    def choose(self, hashes, num_prompt_tokens, queues, now) -> Choice:
        return Choice(self.least_loaded(queues, now, range(len(queues))))


def make_policy(name: str, index: GlobalIndex, coordinator: HybridCoordinator, replica_ids: Sequence[str],
                tokens_per_s: float, seed: int = 0, router: RouterConfig | None = None,
                host_price: HostCopyPrice | None = None) -> SimPolicy:
    args = (index, coordinator, replica_ids, tokens_per_s, seed, router, host_price)
    if name in ("hybrid", "attention_overlap", "round_robin"):
        return RouterPolicy(*args, policy=RoutingPolicy(name))
    table = {"power_of_two": PowerOfTwo, "ray_serve_prefix_affinity": RayServePrefixAffinity, "oracle": Oracle}
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    return table[name](*args)
