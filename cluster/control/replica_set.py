"""The replica actors of one cluster: start (each in its own placement group), stop, purge, health.

Each replica's tensor-parallel ranks are placed through a Ray placement group, one bundle per
rank, `STRICT_PACK` (one node), `num_gpus: 1` per rank on CUDA, as vLLM and Ray Serve LLM place
TP workers: a replica gets all its ranks or waits, never half of them. Rank 0 (the replica actor)
sits in bundle 0; the TPWorker actors of ranks 1..n-1 in the group's other bundles.

Purging (a replica died, reports itself unhealthy, or stopped answering health checks) always
kills the actor and removes its placement group: a purged replica never keeps running beside
its replacement, so the autoscaler's count is the number of live actors.

Replica actors and their placement groups are detached and named (`cluster.ids`): they outlive
the controller that started them, and a restarted controller takes them over (`adopt`), as Ray
Serve's controller recovers its replicas by name (`replica_actors.py`: found by name, stopped).
Anything of the cluster's it does not adopt is stopped, and `shutdown` stops every one of them,
adopted or not.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster.config import ClusterConfig
from cluster.control.replica_actors import named_replicas, replica_groups, stop_replica
from cluster.control.replica_count import REMOVED
from cluster.ids import (
    placement_group_name,
    replica_actor_name,
    replica_id,
    replica_number,
    service_name,
)
from workers.replica import ReplicaUnhealthyError, TransferReplica, actor_options
from workers.replica_messages import ReplicaInfoMsg

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0
SUSPECT_NODE_S = 120.0  # a node that lost a replica (died, stopped answering) gets none this long if another can
ADOPT_TIMEOUT_S = 60.0  # a found replica still loading its model this long is stopped, not adopted


@dataclass
class ReplicaHandle:
    replica_id: str
    actor: object
    info: ReplicaInfoMsg
    placement_group: object = None
    draining: bool = False  # front doors route to it no more; stopped once its requests finished
    missed_health_checks: int = 0


class ReplicaSet:
    def __init__(self, model_dir: str, engine_config, config: ClusterConfig, cluster_name: str, namespace: str | None,
                 secret: str, replica_cls: type = TransferReplica, on_purge=None) -> None:
        """`config`: replica resources, TP size, streams per replica; `cluster_name`: the actor names'.
        `on_purge(replica_id, reason)`: called after a replica was purged (index, channels, restarts)."""
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.config = config
        self.cluster_name = cluster_name
        self.service_name = service_name(cluster_name)
        self.namespace = namespace
        self.secret = secret
        self._cls = ray.remote(**actor_options(config.max_streams_per_replica))(replica_cls)
        self._on_purge = on_purge
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.replicas: dict[str, ReplicaHandle] = {}
        self.fingerprint: str | None = None
        self.num_deaths = 0
        self._suspect_nodes: dict[str, float] = {}  # node id -> when a replica of it was purged as failed

    # ---- lifecycle --------------------------------------------------------------------------
    def add(self, n: int, before_listed: Callable[[str], None] | None = None) -> list[str]:
        """Start `n` replicas in parallel and wait until they serve. `before_listed(replica_id)`:
        called for each just before it is listed in `replicas` (what must hold from its first
        listing on: the controller's role for it)."""
        if n <= 0:
            return []
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.config
        bundle = {"CPU": c.num_cpus_per_rank or 0.001}
        if c.num_gpus_per_rank:
            bundle["GPU"] = c.num_gpus_per_rank
        started = []
        for node in self.spread(n):
            rid = replica_id(next(self._ids))
            pg = placement_group([dict(bundle) for _ in range(c.tp_size)], strategy="STRICT_PACK", lifetime="detached",
                                 name=placement_group_name(self.service_name, rid), _soft_target_node_id=node)
            rank0 = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            ranks = {"num_cpus": c.num_cpus_per_rank, "num_gpus": c.num_gpus_per_rank,
                     "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=-1)}
            actor = self._cls.options(num_cpus=c.num_cpus_per_rank, num_gpus=c.num_gpus_per_rank, max_restarts=0,
                                      name=replica_actor_name(self.cluster_name, rid), namespace=self.namespace,
                                      lifetime="detached", scheduling_strategy=rank0).remote(
                rid, self.model_dir, self.engine_config, c.tp_size, c.distributed_backend, None, None,
                c.max_streams_per_replica, ranks if c.tp_size > 1 else None)
            started.append((rid, actor, pg))
        try:
            infos = ray.get([a.describe.remote() for _, a, _ in started])
            ray.get([a.set_transfer_secret.remote(self.secret) for _, a, _ in started])
        except Exception:
            for _, actor, pg in started:  # a replica that cannot start must not hold its placement group
                stop_replica(actor, pg)
            raise
        out = []
        for (rid, actor, pg), info in zip(started, infos):
            if self.fingerprint is not None and info.fingerprint != self.fingerprint:
                stop_replica(actor, pg)
                raise RuntimeError(f"{rid} loaded a different model ({info.fingerprint})")
            self.fingerprint = info.fingerprint
            if before_listed is not None:
                before_listed(rid)
            with self._lock:
                self.replicas[rid] = ReplicaHandle(rid, actor, info, pg)
            out.append(rid)
        log.info("replicas up: %s", ", ".join(f"{i.replica_id}@{i.node_id[:8]}" for i in infos))
        return out

    def spread(self, n: int) -> list[str | None]:
        """A target node per new replica: the alive nodes with the replica's resources holding
        the fewest replicas first (Ray's own placement was seen stacking replicas on one node
        while another was idle). None: one node, let Ray place it.

        A node that lost a replica in the last `SUSPECT_NODE_S` comes last: a lost or partitioned
        host stays alive to Ray for tens of seconds after its replicas were purged, and holds the
        fewest replicas then; a replacement sent there waits until Ray calls it dead (or forever,
        while a partition lasts). The bed's partition test: no replacement within 60 s without this."""
        cpus, gpus = self.config.num_cpus_per_rank, self.config.num_gpus_per_rank
        nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")
                 and node.get("Resources", {}).get("CPU", 0) >= cpus
                 and node.get("Resources", {}).get("GPU", 0) >= gpus]
        if len(nodes) < 2:
            return [None] * n
        with self._lock:
            count = {node: 0 for node in nodes}
            for rep in self.replicas.values():
                if rep.info.node_id in count:
                    count[rep.info.node_id] += 1
            now = time.monotonic()
            suspect = {node for node, t in self._suspect_nodes.items() if now - t < SUSPECT_NODE_S}
        out = []
        for _ in range(n):
            node = min(nodes, key=lambda x: (x in suspect, count[x], nodes.index(x)))
            count[node] += 1
            out.append(node)
        return out

    def attach(self, replica_ids: list[str], service_of) -> None:
        """Point these replicas' event publishers at the cache service (after it exists):
        `service_of(replica_id)`, the name of the shard holding it."""
        with self._lock:
            actors = {r: self.replicas[r].actor for r in replica_ids}
        ray.get([a.attach_service.remote(service_of(r), self.namespace) for r, a in actors.items()])

    # ---- a restarted controller -----------------------------------------------------------------
    def adopt(self, known_ids: Iterable[str] = (), timeout_s: float = ADOPT_TIMEOUT_S) -> list[str]:
        """Take over this cluster's live replica actors, found by name, with their placement
        groups (a restarted controller; none on a first start). A found replica that does not
        answer `describe` within `timeout_s` or loaded another model is stopped; placement groups
        no adopted replica sits in are removed. Adopted replicas get this set's transfer secret.
        New ids continue past every id seen (`known_ids`: the cache service's too): none is reused.
        Returns the adopted ids."""
        found, groups = named_replicas(self.cluster_name, self.namespace), replica_groups(self.service_name)
        seen = [replica_number(r) for r in (*known_ids, *found, *groups)]
        self._ids = itertools.count(max((n for n in seen if n is not None), default=-1) + 1)
        refs = {rid: actor.describe.remote() for rid, actor in found.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        adopted = []
        for rid, actor in sorted(found.items()):
            pg = groups.pop(rid, None)
            try:
                if refs[rid] not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:.0f} s")
                info = ray.get(refs[rid])
                if self.fingerprint is not None and info.fingerprint != self.fingerprint:
                    raise RuntimeError(f"a different model ({info.fingerprint})")
                ray.get(actor.set_transfer_secret.remote(self.secret), timeout=CONTROL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - not adopted: stopped, never left running unseen
                log.warning("replica %s not adopted (%s): stopping it", rid, exc)
                stop_replica(actor, pg)
                continue
            self.fingerprint = info.fingerprint
            with self._lock:
                self.replicas[rid] = ReplicaHandle(rid, actor, info, pg)
            adopted.append(rid)
        for rid, pg in groups.items():  # its replica is gone: nothing may hold its resources
            log.warning("placement group of %s has no replica: removing it", rid)
            stop_replica(None, pg)
        if adopted:
            log.info("replicas adopted: %s", ", ".join(adopted))
        return adopted

    def purge(self, replica_id: str, reason: str) -> bool:
        """Forget and stop a replica (`reason`: REMOVED when on purpose, else why it was purged:
        counted as a death). True if it was still known."""
        with self._lock:
            rep = self.replicas.pop(replica_id, None)
        if rep is None:
            return False
        if reason != REMOVED:
            self.num_deaths += 1
            with self._lock:
                self._suspect_nodes[rep.info.node_id] = time.monotonic()
            log.warning("replica %s %s: purging and stopping it", replica_id, reason)
        else:
            try:
                ray.get(rep.actor.shutdown.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - stopping it anyway
                pass
        stop_replica(rep.actor, rep.placement_group)
        if self._on_purge is not None:
            self._on_purge(replica_id, reason)
        return True

    # ---- health -----------------------------------------------------------------------------
    def check_health(self, max_missed: int = 3, timeout_s: float = CONTROL_TIMEOUT_S) -> list[str]:
        """Ping every replica (its control group: never queued behind streams). Purge the dead,
        the unhealthy, and those that missed `max_missed` checks in a row. Returns the purged."""
        with self._lock:
            reps = list(self.replicas.values())
        refs = [(rep, rep.actor.ping.remote()) for rep in reps]
        purged = []
        for rep, ref in refs:
            try:
                ray.get(ref, timeout=timeout_s)
                rep.missed_health_checks = 0
            except ReplicaUnhealthyError as exc:
                purged += [rep.replica_id] if self.purge(rep.replica_id, f"unhealthy ({exc})") else []
            except RayActorError:
                purged += [rep.replica_id] if self.purge(rep.replica_id, "died") else []
            except GetTimeoutError:
                rep.missed_health_checks += 1
                if rep.missed_health_checks >= max_missed and self.purge(rep.replica_id, "stopped answering"):
                    purged.append(rep.replica_id)
        return purged

    # ---- views ----------------------------------------------------------------------------
    def get(self, replica_id: str) -> ReplicaHandle | None:
        return self.replicas.get(replica_id)

    @property
    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self.replicas)

    def routable(self) -> list[str]:
        with self._lock:
            return sorted(r for r, rep in self.replicas.items() if not rep.draining)

    def shutdown(self) -> None:
        """Stop every replica actor and placement group of the cluster (detached: nothing else
        would), those this set does not know included."""
        with self._lock:
            reps = list(self.replicas.values())
            self.replicas.clear()
        try:  # stop engines (and TP workers) cleanly, then make sure
            ray.wait([rep.actor.shutdown.remote() for rep in reps], num_returns=len(reps), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        for rep in reps:
            stop_replica(rep.actor, rep.placement_group)
        try:
            groups = replica_groups(self.service_name)
            for rid, actor in named_replicas(self.cluster_name, self.namespace).items():
                stop_replica(actor, groups.pop(rid, None))
            for pg in groups.values():
                stop_replica(None, pg)
        except Exception:  # noqa: BLE001 - Ray going down meanwhile
            log.debug("replica sweep at shutdown failed", exc_info=True)
