"""The cache service's shards as the controller drives them (`cluster.cache_service.shards`, one by default).

    shard k    a detached named actor (`cache_service.shards.shard_service_name`): found by name
               (a restarted controller keeps its index) or started
    replica r  registered on, purged from and pushing its events to shard `shard_of(r, N)` only

Front doors route on read replicas of every shard (`frontdoor/routing_client.py`); the
controller's own estimates (warm-up) ask every shard for its replicas' estimates and merge them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import ray

from cache_service.messages import RouteDecision, RouteRequestMsg
from cache_service.shards import shard_of, shard_service_name
from cluster.control.service_actor import start_cache_service

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0


class ServiceShards:
    def __init__(self, service_name: str, namespace: str | None, num_shards: int) -> None:
        self.service_name = service_name
        self.namespace = namespace
        self.names = [shard_service_name(service_name, k) for k in range(num_shards)]
        self.handles: list = [self._find(name) for name in self.names]

    def _find(self, name: str):
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None

    @property
    def num_shards(self) -> int:
        return len(self.names)

    @property
    def running(self) -> bool:
        """Every shard was found running (this controller was restarted)."""
        return all(h is not None for h in self.handles)

    def start(self, *args, **kwargs) -> None:
        """Start the shards not running (`CacheService(*args, **kwargs)` each)."""
        for k, name in enumerate(self.names):
            if self.handles[k] is None:
                self.handles[k] = start_cache_service(name, self.namespace, *args, detached=True, **kwargs)

    def name_of(self, replica_id: str) -> str:
        """The shard actor `replica_id` pushes its events to."""
        return self.names[shard_of(replica_id, self.num_shards)]

    def of(self, replica_id: str):
        return self.handles[shard_of(replica_id, self.num_shards)]

    def known_replicas(self) -> list[str]:
        """The replicas the running shards know (none from a shard not running or answering)."""
        out: list[str] = []
        for h in self.handles:
            if h is None:
                continue
            try:
                out += list(ray.get(h.stats.remote(), timeout=30)["replicas"])
            except Exception:  # noqa: BLE001 - restarting: it learns the live replicas from their pushes
                pass
        return out

    def add(self, replica_ids: Iterable[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
        ray.get([self.of(r).add_replica.remote(r) for r in replica_ids], timeout=timeout_s)

    def remove(self, replica_ids: Iterable[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
        ray.get([self.of(r).remove_replica.remote(r) for r in replica_ids], timeout=timeout_s)

    def loads(self, timeout_s: float = 5.0) -> dict[str, dict]:
        """Every replica's load as its shard sees it. Raises if a shard does not answer."""
        stats = ray.get([h.stats.remote() for h in self.handles], timeout=timeout_s)
        return {r: load for s in stats for r, load in s["loads"].items()}

    def estimate(self, msg: RouteRequestMsg, timeout_s: float) -> RouteDecision | None:
        """The service's estimates for `msg` (a dry run). Sharded: every shard's own decision over
        its replicas, merged: the estimates of all, the replica with the best hit chosen (what
        warming needs: who holds the most of the prompt). None when a shard is down or none
        knows a replica."""
        decisions = ray.get([h.route_many.remote([msg]) for h in self.handles], timeout=timeout_s)
        decisions = [d[0] for d in decisions if d[0] is not None]
        if len(self.handles) == 1 or not decisions:
            return decisions[0] if decisions else None
        by_replica = {e.replica_id: e for d in decisions for e in d.estimates}
        best = max(decisions, key=lambda d: (d.expected_hit_tokens, d.replica_id))
        estimates = tuple(sorted(by_replica.values(), key=lambda e: e.replica_id))
        return RouteDecision(best.replica_id, best.policy, best.expected_hit_tokens, estimates,
                             load_only=all(d.load_only for d in decisions))
