"""The simulated-time loop: each trace request, in arrival order, is routed, looks up the chosen
replica's real cache, queues its prefill of the tokens it recomputes, and publishes its blocks
and snapshots (retention + junctions) when that prefill ends.

    now = arrival
    publish every prefill that finished by now      (group managers -> events -> global index)
    choice  = policy(hashes, queues, now)           (the real Router for hybrid & co.)
    [transfer holder -> choice: pages stored on the destination, time added to its prefill]
    hit     = coordinator over the replica's pools  (the same code a worker runs; host-tier
              pages count as cached)
    promote = the hit's host-only pages x page bytes / host_to_device_bytes_per_s (with a
              transfer: also the source's host-only pages of what it sends)
    TTFT    = queue wait + prefill(N - hit) [+ transfer] [+ promote];  finish = TTFT + decode(output)

The promotion copy is priced when the request is served (its hit is read then) and runs in the
replica's queue ahead of its prefill, as a transfer does: the prefill reads the promoted pages.
(The pages themselves are promoted when the prefill's admission runs, at publication; a page
demoted or promoted by another request in between is not re-priced.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from cache_service.block_hash import RequestBlockHashes
from cache_service.checkpoint_grid import on_grid
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.eviction import EvictionConfig
from cache_service.eviction_policy import RecomputeCost
from cache_service.global_index import GlobalIndex
from cache_service.ids import replica_id
from cache_service.messages import HostCopyPrice
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.router import RouterConfig
from cache_service.trace_sim.config import CostModel, SimLayout
from cache_service.trace_sim.hashing import TraceHasher
from cache_service.trace_sim.pd_split import PdSplit
from cache_service.trace_sim.policies import Choice, make_policy
from cache_service.trace_sim.prefill_queue import PrefillQueue
from cache_service.trace_sim.replica import SimReplica
from cache_service.trace_sim.trace import TraceRequest

DECODE_MODELS = ("independent", "stepped")


@dataclass(frozen=True)
class SimSettings:
    layout: SimLayout
    cost: CostModel
    num_replicas: int
    policy: str
    budget_bytes: int  # cache memory per replica (KV + Mamba state)
    retention: str = "latest"  # latest, dense, an interval, or value:BYTES (cache_service/placement.py)
    eviction: str = "value"  # of retained Mamba states: value[:T|auto] | lru | marconi[:ALPHA] (eviction.py)
    eagle: str = "off"
    mamba_fraction: float = 0.25  # share of the budget for state pages (when the layout has any)
    host_bytes: int = 0  # host-tier memory per replica, split as budget_bytes is (0: no host tier)
    seed: int = 0
    router: RouterConfig = RouterConfig()  # the live defaults (junction credit included)
    # independent: a prefill queue per replica, decode beside it (prefill_queue.py); stepped:
    # decode steps with interference and per-token latencies (step_timeline.py, stepped_engine.py)
    decode_model: str = "independent"
    pd_split: PdSplit | None = None  # prefill and decode replicas (stepped only); None: mixed
    checkpoint_grid: str = "mamba"  # where states sit: mamba | attention (cache_service/checkpoint_grid.py)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.num_replicas}")
        if self.decode_model not in DECODE_MODELS:
            raise ValueError(f"--decode-model must be one of {', '.join(DECODE_MODELS)}, got {self.decode_model!r}")
        if self.decode_model == "stepped" and self.cost.step_token_budget is None:
            raise ValueError(f"cost model {self.cost.name!r} has no step_token_budget: add it "
                             "(configs/sim/cost.yaml) to simulate decode steps")
        if self.pd_split is not None:
            if self.decode_model != "stepped":
                raise ValueError("--pd-split needs the stepped decode model")
            if self.pd_split.num_replicas != self.num_replicas:
                raise ValueError(f"--pd-split {self.pd_split} has {self.pd_split.num_replicas} replicas, "
                                 f"--replicas is {self.num_replicas}")
            if self.policy == "oracle":
                raise ValueError("--pd-split: the oracle's one shared cache has no prefill/decode roles")
        if not 0.0 < self.mamba_fraction < 1.0:
            raise ValueError(f"--mamba-fraction must be in (0, 1), got {self.mamba_fraction}")
        if self.budget_bytes <= 0:
            raise ValueError("--memory-gib must be positive")
        if self.host_bytes < 0:
            raise ValueError(f"--host-memory-gib must be >= 0, got {self.host_bytes} bytes")
        if self.host_bytes and self.cost.host_to_device_bytes_per_s is None:
            raise ValueError(f"cost model {self.cost.name!r} has no host_to_device_bytes_per_s: "
                             "add it (configs/sim/cost.yaml) to simulate a host tier")
        self.layout.host_pages(self.host_bytes, self.mamba_fraction)  # raises when too small


@dataclass(frozen=True)
class RequestRecord:
    index: int
    arrival_s: float
    replica: int
    input_tokens: int
    output_tokens: int
    hit_tokens: int
    attention_match_tokens: int
    transfer_tokens: int
    ttft_s: float
    finish_s: float
    host_hit_tokens: int = 0  # the hit's tokens when it promoted any page from the host tier
    promoted_bytes: int = 0  # bytes copied back from the host tier for the hit (priced in ttft_s)


@dataclass(frozen=True)
class Served:
    """The cache side of serving one request (`ClusterSim.serve`), before any compute is priced."""

    hit: HitResult
    num_prefill_tokens: int  # the prompt tokens past the hit: recomputed
    num_moved: int  # tokens whose pages a transfer moved here first
    transfer_s: float  # that transfer's seconds (paid before the prefill)
    promoted_bytes: int  # host-tier bytes copied back for the hit (and the transfer's source)
    junctions: tuple[int, ...]


class ClusterSim:
    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        layout, spacing = on_grid(settings.layout.layout, settings.checkpoint_grid)
        self.coordinator = HybridCoordinator(layout, settings.eagle)
        pages = settings.layout.page_bytes
        self._state_bytes = sum(p for g, p in zip(layout.groups, pages) if not g.is_attention)
        self.eviction = EvictionConfig(settings.eviction, settings.layout.attention_crossover_tokens)
        retention = make_retention(settings.retention, layout.alignment, self._state_bytes,
                                   RecomputeCost(settings.layout.attention_crossover_tokens), spacing)
        self.planner = CheckpointPlanner(self.coordinator, retention)
        state_page = max((p for g, p in zip(layout.groups, pages) if not g.is_attention), default=1)
        self.index = GlobalIndex(len(layout.groups))
        ids = [replica_id(i) for i in range(settings.num_replicas)]
        self.replica_ids = ids
        routed = ids[: settings.pd_split.num_prefill] if settings.pd_split is not None else ids  # the prefill side
        self._attention_bytes_per_token = sum(p / g.block_size for g, p in zip(layout.groups, pages) if g.is_attention)
        self.policy = make_policy(settings.policy, self.index, self.coordinator, routed,
                                  settings.cost.prefill_tokens_per_s, settings.seed, settings.router,
                                  self._host_price())
        self.queues = [PrefillQueue(settings.cost.decode_step_s) for _ in routed]
        scale = settings.num_replicas if self.policy.shared_cache else 1  # the oracle: one cache of R budgets
        blocks = settings.layout.pool_blocks(settings.budget_bytes * scale, settings.mamba_fraction)
        host = settings.layout.host_pages(settings.host_bytes * scale, settings.mamba_fraction)

        def replica(name: str, index: GlobalIndex | None) -> SimReplica:
            return SimReplica(name, self.coordinator, self.planner, blocks, index, self.eviction, state_page,
                              host_pages=host, page_bytes=pages)

        if self.policy.shared_cache:
            self.caches = [replica("oracle", None)] * len(ids)
        else:
            self.caches = [replica(r, self.index) for r in ids]
            self.policy.room = self._room_of(layout, ids)
        self.num_blocks_per_group = blocks
        self.num_host_pages_per_group = host
        self._pending: list[tuple[float, int, int, RequestBlockHashes, int, int, tuple[int, ...]]] = []
        self._seq = itertools.count()
        self._hashers: dict[int, TraceHasher] = {}  # per trace block size

    def _room_of(self, layout, ids: Sequence[str]):
        """room(r): the tokens of KV replica r takes without evicting, as a live replica reports
        it (`LoadReportMsg.num_empty_blocks`: its first attention group's free blocks that hold
        nothing); always up to date here (a live report lags by at most a step)."""
        group = layout.attention_group_ids[0] if layout.attention_group_ids else None
        if group is None:
            return None
        pools = {r: cache.cache.pools[group] for r, cache in zip(ids, self.caches)}
        block = layout.groups[group].block_size
        return lambda r: pools[r].num_free_empty_blocks * block if r in pools else None

    def _host_price(self) -> HostCopyPrice | None:
        """What each replica would report for a host hit (`messages.HostCopyPrice`): the cost
        model's copy seconds of a hit's state pages and of one token's KV pages, in prefill tokens;
        None without a host tier."""
        cost = self.settings.cost
        if not self.settings.host_bytes:
            return None
        scale = cost.prefill_tokens_per_s / cost.host_to_device_bytes_per_s
        return HostCopyPrice(self._state_bytes * scale, self._attention_bytes_per_token * scale,
                             cost.host_to_device_bytes_per_s)

    def _publish_until(self, now: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now:
            _, _, replica, hashes, hit_tokens, num_tokens, junctions = heapq.heappop(pending)
            self.caches[replica].publish(hashes, hit_tokens, num_tokens, junctions)

    def _hash(self, req: TraceRequest) -> RequestBlockHashes:
        h = self.coordinator.layout.hash_block_size
        if req.block_tokens % h:  # a scaled trace whose blocks split hash blocks: hash the tokens
            return RequestBlockHashes(h, req.tokens())
        hasher = self._hashers.get(req.block_tokens)
        if hasher is None:
            hasher = self._hashers[req.block_tokens] = TraceHasher(h, req.block_tokens)
        return hasher.hashes(req)

    def _forced(self, hashes: RequestBlockHashes, n: int, target: int) -> Choice:
        hits = [cache.lookup(hashes, n).hit_tokens for cache in self.caches]
        best = max(range(len(hits)), key=lambda i: (hits[i], -i))
        return Choice(target, best, hits[best]) if hits[best] > hits[target] else Choice(target)

    def step(self, req: TraceRequest, forced_replica: int | None = None) -> RequestRecord:
        """`forced_replica`: serve there instead of asking the policy (replaying a live cluster's
        placements, e.g. to compare hits with it); as the live front door does for a forced
        target, the pages of a replica that hits more are moved there first."""
        if self.settings.decode_model != "independent":
            raise ValueError("stepped settings need stepped_engine.make_cluster_sim")
        now = req.arrival_s
        self._publish_until(now)
        hashes = self._hash(req)
        if forced_replica is not None:
            choice = self._forced(hashes, req.input_length, forced_replica)
        else:
            choice = self.policy.choose(hashes.hashes, req.input_length, self.queues, now)
        served = self.serve(req, hashes, choice)
        cost = self.settings.cost
        first, finish = self.queues[choice.replica].admit(
            now, cost.prefill_s(served.num_prefill_tokens) + served.transfer_s + cost.promote_s(served.promoted_bytes),
            cost.decode_s(req.output_length), served.num_prefill_tokens)
        heapq.heappush(self._pending, (first, next(self._seq), choice.replica, hashes, served.hit.hit_tokens,
                                       req.input_length, served.junctions))
        return RequestRecord(req.index, now, choice.replica, req.input_length, req.output_length,
                             served.hit.hit_tokens, served.hit.attention_match_tokens, served.num_moved,
                             first - now, finish, served.hit.hit_tokens if served.promoted_bytes else 0,
                             served.promoted_bytes)

    def serve(self, req: TraceRequest, hashes: RequestBlockHashes, choice: Choice) -> Served:
        """The cache side of serving `req` on `choice.replica`: the planned transfer (pages stored
        on the destination), the hit there and what promoting it copies; mutates the caches (and
        the value retention's statistics), not the compute."""
        n = req.input_length
        cache = self.caches[choice.replica]
        transfer_s = 0.0
        num_moved = 0
        if choice.transfer_src is not None:  # move only what the source really holds
            num_moved = min(choice.transfer_tokens, self.caches[choice.transfer_src].lookup(hashes, n).hit_tokens)
        cost = self.settings.cost
        promoted = 0  # host-tier bytes this request's hit copies back to a device
        if num_moved:
            # the source sends pages it holds on its host tier too (copied up first), and the
            # destination registers the transfer over its own hit (which may promote)
            promoted = self.caches[choice.transfer_src].promoted_bytes(hashes, num_moved)
            stored = cache.receive_transfer(hashes, num_moved)
            promoted += sum(k * b for k, b in zip(stored.num_promoted_pages, self.settings.layout.page_bytes))
            moved = num_moved * self._attention_bytes_per_token + self._state_bytes
            transfer_s = moved / cost.transfer_bytes_per_s
        hit = cache.lookup(hashes, n)
        promoted += cache.promoted_bytes(hashes, hit.hit_tokens)
        self.planner.observe(hit.attention_match_tokens)
        return Served(hit, n - hit.hit_tokens, num_moved, transfer_s, promoted, self.coordinator.junctions(hit))

    def run(self, requests: Iterable[TraceRequest],
            on_step: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        records = []
        for req in requests:
            record = self.step(req)
            records.append(record)
            if on_step is not None:
                on_step(record)
        self._publish_until(float("inf"))
        return records

    def memory_split(self) -> dict[str, int]:
        """Cached bytes at the end, attention KV vs recurrent state, summed over distinct caches."""
        groups = self.coordinator.layout.groups
        kv = state = 0
        for cache in {id(c): c for c in self.caches}.values():
            for g, size in zip(groups, cache.cached_bytes(self.settings.layout.page_bytes)):
                if g.is_attention:
                    kv += size
                else:
                    state += size
        return {"kv_bytes": kv, "state_bytes": state}


def record_dict(record: RequestRecord) -> dict:
    return asdict(record)
