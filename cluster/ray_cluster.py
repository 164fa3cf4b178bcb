"""Ray wiring: an embedded local cluster (bound to 127.0.0.1), the cache-service actor and the
replica actors, and a client that routes each request by the cache service's decision.

    client.generate(msg)
      1. pull each replica's cache events into the cache service (resync on a gap)
      2. route: the replica whose reconciled hybrid hit + load is cheapest
      3. call that replica; if it died, purge it and retry on another (no accepted request lost)
      4. if the cache service itself is gone, route by load alone until it is back
"""

from __future__ import annotations

import logging
import os

import ray
from ray.exceptions import RayActorError

from cache_service.service import CacheService
from workers.replica import GenerateMsg, Replica

log = logging.getLogger(__name__)


def start_local_ray(num_cpus: int = 2) -> None:
    """Embedded cluster on loopback only."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, configure_logging=False)


class ClusterClient:
    def __init__(self, model_dir: str, engine_config, num_replicas: int, policy: str = "hybrid") -> None:
        replica_cls = ray.remote(num_cpus=0, max_restarts=0)(Replica)
        self.replicas = {f"replica-{i}": replica_cls.remote(f"replica-{i}", model_dir, engine_config)
                         for i in range(num_replicas)}
        first = next(iter(self.replicas.values()))
        groups, eagle, fingerprint = ray.get([first.layout_groups.remote(), first.eagle_mode.remote(),
                                              first.model_fingerprint.remote()])
        self._service_args = (groups, eagle, fingerprint, policy)
        self.service_cls = ray.remote(num_cpus=0, max_restarts=-1)(CacheService)
        self.service = self.service_cls.remote(*self._service_args)
        ray.get([self.service.add_replica.remote(r) for r in self.replicas])
        self.num_retries = 0
        self._rr = 0

    def _sync(self) -> None:
        drained = ray.get([a.drain_events.remote() for a in self.replicas.values()])
        for replica_id, events in drained:
            if not ray.get(self.service.ingest.remote(replica_id, events)):
                contents, next_seq = ray.get(self.replicas[replica_id].snapshot.remote())
                ray.get(self.service.resync.remote(replica_id, contents, next_seq))

    def _pick(self, msg: GenerateMsg) -> tuple[str, int]:
        queued = {r: 0 for r in self.replicas}
        try:
            self._sync()
            decision = ray.get(self.service.route.remote(msg.prompt_token_ids, msg.cache_salt, queued), timeout=10)
            return decision.replica_id, decision.expected_hit_tokens
        except (RayActorError, ray.exceptions.GetTimeoutError) as exc:  # cache service down: load only
            log.warning("cache service unavailable (%s): routing by load", type(exc).__name__)
            self._rr += 1
            return sorted(self.replicas)[self._rr % len(self.replicas)], 0

    def generate(self, msg: GenerateMsg, replica_id: str | None = None) -> dict:
        while self.replicas:
            target = replica_id if replica_id in self.replicas else self._pick(msg)[0]
            try:
                return ray.get(self.replicas[target].generate.remote(msg))
            except RayActorError:
                log.warning("replica %s died: purging it and retrying the request elsewhere", target)
                self.replicas.pop(target, None)
                self.num_retries += 1
                replica_id = None
                try:
                    ray.get(self.service.remove_replica.remote(target))
                except RayActorError:
                    pass
        raise RuntimeError("no replica left to serve the request")

    def kill_replica(self, replica_id: str) -> None:
        ray.kill(self.replicas[replica_id], no_restart=True)

    def shutdown(self) -> None:
        for actor in self.replicas.values():
            ray.kill(actor, no_restart=True)
        ray.kill(self.service, no_restart=True)
