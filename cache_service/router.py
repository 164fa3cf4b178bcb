"""Routing by estimated cost: the prefill of the tokens each replica would *really* recompute
(the reconciled hybrid hit, with the coordinator's semantics) plus its load.

Policies, for comparison:
    hybrid             cost = prefill(N - hit(r) - c * (match(r) - hit(r))) + load(r); may plan a
                       transfer (hit: the reconciled hit; match: the attention match; c: the
                       junction credit, below)
    attention_overlap  like routers built for dense models: counts matched attention blocks
                       only, blind to where Mamba snapshots live
    round_robin, random
Every replica is scored in one pass over the prompt's chain (`scorer.AllReplicaScorer`): a
decision costs O(blocks + replicas), not a coordinator run per replica. Equal costs prefer the
replica holding more of the prompt's attention KV, then the less loaded one, then a random one
(an idle cluster spreads requests instead of sending all of them to the first replica).
Junction credit: where a replica's attention match runs past its reconciled hit (a follow-up turn
or a sibling sharing a prefix, under latest-only retention), serving the request there snapshots
the junction at the match (`HybridCoordinator.junctions`), so the conversation's next request
hits it on that replica; elsewhere no junction forms and the session's KV and state drift apart.
The credit `c` (0 <= c < 1) prices that future hit against load: a fraction of the match beyond
the hit counts as saved, less than a real hit of the same length (c < 1): at equal load a replica
with a real hit h beats one holding only KV for a match m < h / c.
A transfer competes when the best holder is busy: a less-loaded replica receives the holder's
KV pages and Mamba page for the hit, then serves a normal local hit. Only onto a replica whose last
report shows room for the pages it lacks in blocks that hold nothing (`room`): on a full replica
the copy evicts cached prefixes to hold a second copy of one that exists (`transfer_may_evict`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from cache_service.block_hash import BlockHash
from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.link_costs import LinkCostConfig
from cache_service.messages import HostCopyPrice, ReplicaEstimate, RouteDecision, TransferPlan
from cache_service.scorer import AllReplicaScorer


class RoutingPolicy(str, Enum):
    HYBRID = "hybrid"
    ATTENTION_OVERLAP = "attention_overlap"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


@dataclass(frozen=True)
class RouterConfig:
    """The `router` section of the serving config (`cluster.config.ServeConfig`)."""

    policy: str = "hybrid"  # a RoutingPolicy value
    prefill_cost_per_token: float = 1.0  # relative units; only ratios matter
    load_cost_per_queued_token: float = 1.0
    transfer_cost_per_token: float = 0.05  # moving a token's pages vs recomputing it
    # copying a token's pages from a replica's host tier to its device vs recomputing it, for a
    # replica that has not measured its own price yet (each measures and reports one:
    # `messages.HostCopyPrice`); PCIe-class copies: cheaper than a transfer, dearer than a device hit
    host_cost_per_token: float = 0.02
    min_transfer_tokens: int = 256
    # share of the attention match beyond the reconciled hit credited as saved (a junction forms
    # there); 0.5 measured on the Mooncake trace (README "Trace-driven simulation")
    junction_credit: float = 0.5
    # a planned transfer may land on a replica that must evict cached pages to hold it (False:
    # only where its last report shows empty blocks for what it lacks; replicas that report none
    # are taken as roomy). Measured with `python -m bench.routing_pressure` (README)
    transfer_may_evict: bool = False
    # a planned transfer is done only where the measured link beats recomputing (`link_costs.py`)
    links: LinkCostConfig = field(default_factory=LinkCostConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.host_cost_per_token < self.prefill_cost_per_token:
            raise ValueError(f"router.host_cost_per_token must be in [0, prefill_cost_per_token "
                             f"{self.prefill_cost_per_token}), got {self.host_cost_per_token}")
        if not 0.0 <= self.junction_credit < 1.0:
            raise ValueError(f"router.junction_credit must be in [0, 1), got {self.junction_credit}")
        if self.policy not in {p.value for p in RoutingPolicy}:
            choices = ", ".join(p.value for p in RoutingPolicy)
            raise ValueError(f"router.policy must be one of {choices}, got {self.policy!r}")


MAX_ESTIMATES = 8  # holders listed in a decision (the front door moves pages from the best one)


@dataclass(frozen=True)
class ReplicaHits:
    """Per replica id: the reconciled hit and the attention match in tokens (absent: 0), and
    whether the index vouched for any candidate (False: a decision by load only). `host_tokens`:
    the part of a hit that only the replica's host tier serves (its pages are copied to the device
    first; absent: 0)."""

    hit_tokens: dict[str, int]
    attention_tokens: dict[str, int]
    any_vouched: bool
    host_tokens: dict[str, int] = field(default_factory=dict)

    def priced(self, prices: Callable[[str], HostCopyPrice | None]) -> dict[str, HostCopyPrice]:
        """The measured price of each replica with host tokens (`prices`: a replica's last report;
        those that reported none are absent: the configured price applies)."""
        out = {}
        for r in self.host_tokens:
            price = prices(r)
            if price is not None:
                out[r] = price
        return out


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
              queued_tokens: Mapping[str, int] | None = None, candidates: Collection[str] | None = None,
              forced: str | None = None, host_prices: Mapping[str, HostCopyPrice] | None = None,
              room: Callable[[str], int | None] | None = None) -> RouteDecision:
        """`candidates` (default: the keys of `queued_tokens`, else every indexed replica) with
        their load in `queued_tokens` (missing: 0). Candidates the index cannot vouch for (stale,
        unknown) count as hitting nothing. Costs O(blocks + replicas): only replicas that hit
        something are costed one by one; the others differ only in load. `forced` (if a
        candidate) is chosen whatever it costs. The decision's estimates list the chosen replica
        and the `MAX_ESTIMATES` best holders. `host_prices`: each replica's measured price of a
        host hit (absent: `host_cost_per_token`). `room(r)`: the tokens of KV replica r can take
        without evicting (None: not reported, taken as roomy; `room` None: every replica)."""
        load = queued_tokens if queued_tokens is not None else {}
        if candidates is None:
            candidates = load.keys() if queued_tokens is not None else self.index.replicas.keys()
        if not candidates:
            raise NoReplicaError("no routable replica")
        if self.policy in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.RANDOM):
            return self.decide(ReplicaHits({}, {}, False), num_prompt_tokens, load, candidates, forced)
        return self.decide(self.hits(hashes, num_prompt_tokens, candidates), num_prompt_tokens, load, candidates,
                           forced, host_prices=host_prices, room=room)

    def hits(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
             candidates: Collection[str] | None) -> ReplicaHits:
        """Each candidate's hit on this router's index (the scatter half of a sharded route: a
        replica's hit depends on its own entries only); None: every indexed replica."""
        everyone = self.index.routable_mask() if candidates is None else self.index.mask_of(candidates)
        if not everyone:
            return ReplicaHits({}, {}, False)
        scores = self.scorer.score(hashes, num_prompt_tokens, self.index.holders, everyone)
        by_bit = self.index.by_bit
        attention = {by_bit[b]: v for b, v in scores.attention_tokens.items()}
        if self.policy is RoutingPolicy.ATTENTION_OVERLAP:
            return ReplicaHits(attention, attention, True)
        hits = {by_bit[b]: v for b, v in scores.hit_tokens.items()}
        host: dict[str, int] = {}
        if self.index.has_host_entries:  # both tiers: a larger hit, its extra pages copied from the host
            tiers = self.scorer.score(hashes, num_prompt_tokens, self.index.tiers_view(), everyone)
            for b, v in tiers.hit_tokens.items():
                if v > hits.get(by_bit[b], 0):
                    host[by_bit[b]] = v - hits.get(by_bit[b], 0)
                    hits[by_bit[b]] = v
        return ReplicaHits(hits, attention, True, host)

    def decide(self, scored: ReplicaHits, num_prompt_tokens: int, load: Mapping[str, int],
               candidates: Collection[str], forced: str | None = None,
               by_load: Iterable[tuple[int, str]] | None = None,
               host_prices: Mapping[str, HostCopyPrice] | None = None,
               room: Callable[[str], int | None] | None = None) -> RouteDecision:
        """The decision given every candidate's hits (the gather half: `scored` may merge the
        `hits` of several indexes over disjoint replicas). `by_load`: (load, replica) in
        ascending order, every candidate among them (others are skipped): the least loaded
        replicas are then found without looking at every candidate. `host_prices`: each
        replica's measured price of its host tokens (absent: `host_cost_per_token` each). `room(r)`:
        the tokens of KV replica r takes without evicting (None: not reported, roomy)."""
        if not candidates:
            raise NoReplicaError("no routable replica")
        policy = self.policy.value
        if self.policy in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.RANDOM):
            replicas = sorted(candidates)
            pick = (replicas[next(self._rr) % len(replicas)] if self.policy is RoutingPolicy.ROUND_ROBIN
                    else self._rng.choice(replicas))
            return RouteDecision(pick, policy, 0, ())
        hits, attention, everyone = scored.hit_tokens, scored.attention_tokens, scored.any_vouched
        host = {r: self._host_cost(n, (host_prices or {}).get(r)) for r, n in scored.host_tokens.items()}
        special = hits.keys() | attention.keys()
        best_key, best = None, []
        for r in special:
            n = load.get(r, 0)
            key = (self._cost(num_prompt_tokens, hits.get(r, 0), n, attention.get(r, 0), host.get(r, 0)),
                   -attention.get(r, 0), n)
            if best_key is None or key < best_key:
                best_key, best = key, [r]
            elif key == best_key:
                best.append(r)
        if by_load is not None:
            least, idle = _least_loaded(by_load, special, candidates)
        else:
            rest = candidates - special if special else candidates
            least = min((load.get(r, 0) for r in rest), default=None)
            idle = [r for r in rest if load.get(r, 0) == least] if least is not None else []
        if idle:
            key = (self._cost(num_prompt_tokens, 0, least), 0, least)
            if best_key is None or key < best_key:
                best_key, best = key, idle
            elif key == best_key:
                best = best + idle
        chosen = best[0] if len(best) == 1 else self._rng.choice(sorted(best))
        if forced is not None and forced in candidates:
            chosen = forced
        holders = sorted(special, key=lambda r: (-hits.get(r, 0), -attention.get(r, 0), r))[:MAX_ESTIMATES]
        estimate = {r: ReplicaEstimate(r, hits.get(r, 0), self._cost(num_prompt_tokens, hits.get(r, 0),
                                                                     load.get(r, 0), attention.get(r, 0),
                                                                     host.get(r, 0)),
                                       attention.get(r, 0))
                    for r in sorted({chosen, *holders})}
        decision = RouteDecision(chosen, policy, hits.get(chosen, 0), tuple(estimate.values()), load_only=not everyone)
        if self.policy is RoutingPolicy.HYBRID and hits and chosen != forced:
            lightest = min(idle) if idle else None
            decision = self._maybe_transfer(decision, num_prompt_tokens, load, best_key[0], lightest, hits,
                                            attention, room)
        return decision

    def _host_cost(self, num_tokens: int, price: HostCopyPrice | None) -> float:
        """Copying a hit's `num_tokens` host part to the device: the replica's measured price (in
        recomputed tokens, priced as prefill), else `host_cost_per_token` a token."""
        c = self.config
        if price is None:
            return num_tokens * c.host_cost_per_token
        return price.of(num_tokens) * c.prefill_cost_per_token

    def _cost(self, num_prompt_tokens: int, hit: int, load: int, match: int = 0, host: float = 0.0) -> float:
        """`match`: the attention match (a junction forms above `hit`; credited for hybrid only,
        where the hit is the reconciled one and so can fall short of the match); `host`: the
        cost of copying the hit's host-tier part to the device (`_host_cost`)."""
        c = self.config
        saved = hit
        if match > hit and self.policy is RoutingPolicy.HYBRID:
            saved += c.junction_credit * (match - hit)
        return (num_prompt_tokens - saved) * c.prefill_cost_per_token + host + load * c.load_cost_per_queued_token

    def _maybe_transfer(self, decision: RouteDecision, num_prompt_tokens: int, load: Mapping[str, int],
                        best_cost: float, lightest: str | None, hits: Mapping[str, int],
                        attention: Mapping[str, int], room: Callable[[str], int | None] | None) -> RouteDecision:
        """`lightest`: the least loaded replica that hits nothing (None: every candidate hits).
        Unless `transfer_may_evict`, a destination must have `room` for the hit's pages it lacks
        (those above its attention match).
        A holder whose hit sits on its host tier promotes the pages to send them; that copy is not
        added here: `transfer_cost_per_token` already prices a move above what the simulator's
        links cost, and adding it lost hit tokens there (README, "Host tier")."""
        c = self.config
        holder = max(decision.estimates, key=lambda e: (e.hit_tokens, -e.cost))
        if holder.hit_tokens < c.min_transfer_tokens:
            return decision
        options = [r for r, h in hits.items() if r != holder.replica_id and h < holder.hit_tokens]
        options += [lightest] if lightest else []
        if room is not None and not c.transfer_may_evict:
            options = [r for r in options
                       if (free := room(r)) is None or free >= holder.hit_tokens - attention.get(r, 0)]
        dst = min(options, key=lambda r: (load.get(r, 0), r), default=None)
        if dst is None:
            return decision
        cost = (self._cost(num_prompt_tokens, holder.hit_tokens, load.get(dst, 0))
                + holder.hit_tokens * c.transfer_cost_per_token)
        if cost >= best_cost:
            return decision
        plan = TransferPlan(holder.replica_id, dst, holder.hit_tokens)
        estimates = decision.estimates
        if dst not in {e.replica_id for e in estimates}:
            estimates = (*estimates, ReplicaEstimate(dst, 0, self._cost(num_prompt_tokens, 0, load.get(dst, 0))))
        return RouteDecision(dst, decision.policy, holder.hit_tokens, estimates, plan)


def _least_loaded(by_load: Iterable[tuple[int, str]], special, candidates) -> tuple[int | None, list[str]]:
    """The least load among candidates not in `special`, and every such candidate carrying it."""
    least, idle = None, []
    for q, r in by_load:
        if least is not None and q != least:
            break
        if r not in special and r in candidates:
            least = q
            idle.append(r)
    return least, idle
