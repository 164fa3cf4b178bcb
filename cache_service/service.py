"""The cluster-wide cache service (a Ray actor body): the global index + the router.

Replicas' events are pulled in batches (`ingest`); a gap asks the caller to resync that replica
from its snapshot. `route` hashes the prompt once (same fingerprint and salt as the workers) and
returns a `RouteDecision`.
"""

from __future__ import annotations

import uuid

from cache_service.block_hash import RequestBlockHashes
from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.router import RouteDecision, Router, RouterConfig, RoutingPolicy
from cache_service.specs import CacheLayout, parse_group_spec


class CacheService:
    def __init__(self, groups: list[str], eagle: str, model_fingerprint: str, policy: str = "hybrid",
                 router_config: RouterConfig | None = None) -> None:
        self.layout = CacheLayout(tuple(parse_group_spec(g) for g in groups))
        self.coordinator = HybridCoordinator(self.layout, eagle)
        self.fingerprint = model_fingerprint
        self.index = GlobalIndex(len(self.layout.groups))
        self.router = Router(self.index, self.coordinator, RoutingPolicy(policy), router_config)
        self.epoch = uuid.uuid4().hex  # a new value after every (Ray) restart: state rebuilt from replicas

    def add_replica(self, replica_id: str) -> None:
        self.index.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> int:
        return self.index.purge(replica_id)

    def ingest(self, replica_id: str, events: list) -> bool:
        """Apply a batch; False means the replica needs a resync: a gap was found, or this service
        does not know it (it was restarted and lost its state, or the replica was never added)."""
        if replica_id not in self.index.replicas:
            return False
        return not self.index.apply(replica_id, events).needs_resync

    def ping(self) -> str:
        return self.epoch

    def resync(self, replica_id: str, contents: list[list[bytes]], next_seq: int) -> None:
        self.index.resync(replica_id, contents, next_seq)

    def route(self, prompt_token_ids: list[int], cache_salt: str | None, queued: dict[str, int]) -> RouteDecision:
        hashes = RequestBlockHashes(self.layout.hash_block_size, prompt_token_ids,
                                    model_fingerprint=self.fingerprint, cache_salt=cache_salt)
        return self.router.route(hashes.hashes, len(prompt_token_ids), queued)

    def stats(self) -> dict:
        return {"epoch": self.epoch, "num_entries": self.index.num_entries, "replicas": {
            r: {"stale": s.stale, "next_seq": s.next_seq, "entries": list(s.num_entries)}
            for r, s in self.index.replicas.items()}}
