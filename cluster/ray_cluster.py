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
import socket

import ray
from ray.exceptions import RayActorError

from cache_service.service import CacheService
from workers.replica import GenerateMsg, TransferReplica

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray(num_cpus: int = 2) -> None:
    """Embedded cluster on loopback only."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, configure_logging=False)


class ClusterClient:
    def __init__(self, model_dir: str, engine_config, num_replicas: int, policy: str = "hybrid") -> None:
        replica_cls = ray.remote(num_cpus=0, max_restarts=0)(TransferReplica)
        self.replicas = {f"replica-{i}": replica_cls.remote(f"replica-{i}", model_dir, engine_config)
                         for i in range(num_replicas)}
        self.ranks = {r: i for i, r in enumerate(self.replicas)}
        init = f"tcp://127.0.0.1:{_free_port()}"
        ray.get([a.init_transfer_group.remote(self.ranks[r], num_replicas, init) for r, a in self.replicas.items()])
        self.num_transfers = self.num_transfer_failures = 0
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

    def _decide(self, msg: GenerateMsg):
        queued = {r: 0 for r in self.replicas}
        try:
            self._sync()
            return ray.get(self.service.route.remote(msg.prompt_token_ids, msg.cache_salt, queued), timeout=10)
        except (RayActorError, ray.exceptions.GetTimeoutError) as exc:  # cache service down: load only
            log.warning("cache service unavailable (%s): routing by load", type(exc).__name__)
            return None

    def _transfer(self, msg: GenerateMsg, src: str, dst: str, num_tokens: int) -> bool:
        """Move the prefix pages src -> dst; on any failure log why and recompute instead."""
        try:
            sent = self.replicas[src].send_prefix.remote(msg.prompt_token_ids, msg.cache_salt, num_tokens,
                                                         self.ranks[dst])
            received = self.replicas[dst].recv_prefix.remote(self.ranks[src])
            ray.get([sent, received], timeout=120)
            self.num_transfers += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any failure falls back to recompute
            log.warning("transfer %s -> %s of %d tokens failed (%s): recomputing", src, dst, num_tokens, exc)
            self.num_transfer_failures += 1
            return False

    def generate(self, msg: GenerateMsg, replica_id: str | None = None) -> dict:
        """Serve one request; `replica_id` forces the replica (the holder's pages are moved there)."""
        while self.replicas:
            decision = self._decide(msg)
            if decision is None:
                self._rr += 1
                by_load = sorted(self.replicas)[self._rr % len(self.replicas)]
                target = replica_id if replica_id in self.replicas else by_load
            else:
                target = replica_id if replica_id in self.replicas else decision.replica_id
                holder = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
                here = next((e.hit_tokens for e in decision.estimates if e.replica_id == target), 0)
                if decision.transfer is not None and decision.transfer.dst_replica == target:
                    self._transfer(msg, decision.transfer.src_replica, target, decision.transfer.num_tokens)
                elif holder is not None and holder.replica_id != target and holder.hit_tokens > here:
                    self._transfer(msg, holder.replica_id, target, holder.hit_tokens)
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
