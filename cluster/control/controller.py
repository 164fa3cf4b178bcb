"""The cluster controller, a detached Ray actor: replica lifecycle, health, autoscaling, warm-up.

    ClusterController (named "<cluster>-controller", lifetime detached)
      ReplicaSet      replica actors in placement groups; purge = stop; health checks
      ServiceShards   the cache service: `cluster.cache_service.shards` named actors it starts, each the
                      index of its replicas (`control.service_shards`; front doors follow them)
      Transfers       page moves (whichever front door asks: one per pair at a time)
      Warmer          new replicas warmed with every front door's hot prefixes (`control.warmup`)
      count keeper    `ReplicaCountKeeper`: with an autoscaler configured, the `ReplicaAutoscaler`
                      over the replicas' own load reports (all front doors' work; this actor is its
                      `ScalableReplicas`; it replaces dead replicas up to min; with `cluster.pd`
                      per role: `role_loads`, `add_replicas(role=)`); without one, the
                      `ReplicaRestarter`, which replaces each dead replica of the fixed count
                      (crash-loop backoff). Never both.

Front doors (`ClusterBackend`) find it by name (`control.controller_handle`): a restarted front
door or driver reattaches to the running cluster instead of starting another. Replicas (with their
placement groups) and the cache service are detached named actors, so they outlive any front door
and the controller itself.

Restarts: Ray restarts a dead controller (`controller_handle.CONTROLLER_MAX_RESTARTS`) with the same
arguments, and `__init__` rebuilds from what is running, not from anything it kept:

    replicas        found by name and adopted (`ReplicaSet.adopt`): the same actors, none started
                    twice; one that does not answer is stopped, as is a placement group without
                    its replica; then topped up to the floor (num_replicas, or min_replicas)
    cache service   every shard found by name (`get_if_exists`): its index stays; replicas it
                    still lists but that are gone are removed from it
    threads         health checks and the count keeper (autoscaler or restarter) start again

Requests in flight are not the controller's: they stream from the replicas to the front doors and
go on. Front doors retry what they asked it while it was down (`cluster.frontdoor`). What a
restart loses: drains in progress (the replica serves again; the autoscaler decides anew), the
restarter's backoff counts, the hot-prefix book and a count of slots below `num_replicas`.
Messages: `cluster.messages`.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time

import ray

from cache_service.router import RouterConfig
from cluster.config import ClusterConfig
from cluster.control.handoffs import Handoffs
from cluster.control.replica_count import REMOVED, ReplicaCountKeeper
from cluster.control.replica_roles import ReplicaRoles, RoleLoad
from cluster.control.replica_set import ReplicaSet
from cluster.control.service_shards import ServiceShards
from cluster.control.transfers import Transfers
from cluster.control.warmup import HotPrefixBook, Warmer, dry_run_estimate
from cluster.ids import new_controller_epoch, service_name
from cluster.messages import (
    HandoffMsg,
    HandoffResultMsg,
    HotPrefixMsg,
    MembershipMsg,
    ReplicaEntryMsg,
    TransferMsg,
    TransferResult,
)

log = logging.getLogger(__name__)

class ClusterController:
    def __init__(self, cluster_name: str, model_dir: str, engine_config, config: ClusterConfig,
                 router: RouterConfig, replica_cls: type) -> None:
        """`config`: replicas, resources, health, transfers, autoscaler; `router`: the cache service's."""
        logging.basicConfig(level=logging.INFO)
        self.config = config
        self.namespace = ray.get_runtime_context().namespace
        self.service_name = service_name(cluster_name)
        self.epoch = new_controller_epoch()  # front doors see a restart by it (the version counts from 0 again)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.replicas = ReplicaSet(model_dir, engine_config, config, cluster_name, self.namespace,
                                   secrets.token_hex(16), replica_cls, on_purge=self._on_purge)
        self._version = 0
        self._lock = threading.RLock()
        self._frontdoors: dict[str, tuple[float, int]] = {}  # front door -> (when, requests unfinished)
        self.shards = ServiceShards(self.service_name, self.namespace, config.cache_service.shards)
        listed = self.shards.known_replicas()
        self.adopted = self.replicas.adopt(listed)
        scaling = config.autoscaler is not None and self.adopted  # restarted: the autoscaler goes on from min
        floor = config.autoscaler.min_replicas if scaling else config.num_replicas
        started = self.replicas.add(max(0, floor - len(self.adopted)))
        first = self.replicas.get(self.replicas.ids[0]).info
        self.shards.start(list(first.groups), first.eagle, first.fingerprint, router.policy, router,
                          drop_rule=engine_config.drop_rule)
        self.service = self.shards.handles[0]
        gone = set(listed) - set(self.adopted)  # died while no controller watched: out of the index
        self.shards.remove(gone, timeout_s=60)
        self.shards.add(started, timeout_s=60)
        self.replicas.attach(started, self.shards.name_of)  # the adopted ones push to their shard already
        initial = self.adopted + started
        if self.restarted:
            log.warning("controller restarted: %d replicas adopted, %d started, %d gone", len(self.adopted),
                        len(started), len(gone))
        self.transfers = Transfers(self.replicas, config.transfer_timeout_s)
        self.handoffs = Handoffs(self.replicas, config.transfer_timeout_s)
        self.roles = ReplicaRoles(config.pd)
        self._pin(initial)
        estimate = functools.partial(dry_run_estimate, self.shards, first.hash_block_size, first.fingerprint,
                                     self.replicas.routable)
        self.hot = HotPrefixBook(config.hot_prefixes)
        self.warmer = Warmer(self.hot, estimate, self.transfers.transfer)
        self.keeper = ReplicaCountKeeper(self, self._start_replica, config.autoscaler, config.restart)
        self.keeper.started(initial)
        self.autoscaler = self.keeper.autoscaler
        self._stop = threading.Event()
        if config.health_interval_s > 0:
            threading.Thread(target=self._health_loop, name="replica-health", daemon=True).start()
        self.keeper.start()

    # ---- membership ---------------------------------------------------------------------------
    def ready(self) -> bool:
        return True

    def membership(self) -> MembershipMsg:
        with self._lock:
            entries = tuple(ReplicaEntryMsg(r.replica_id, r.actor, r.info, r.draining, self.roles.role_of(r.replica_id))
                            for r in self.replicas.replicas.values())
            return MembershipMsg(self._version, entries, self.service_name, self.namespace, self.epoch,
                                 self.shards.num_shards)

    def _changed(self) -> None:
        with self._lock:
            self._version += 1

    def _on_purge(self, replica_id: str, reason: str) -> None:
        try:
            self.shards.remove([replica_id])
        except Exception:  # noqa: BLE001 - the service is down; a restarted one never hears from it
            pass
        self.transfers.forget_replica(replica_id)
        self.roles.forget(replica_id)
        self._changed()
        self.keeper.purged(replica_id, reason)  # a death: the restarter (if it keeps the count) replaces it

    def report_failure(self, replica_id: str, reason: str) -> None:
        """A front door saw `replica_id` fail (died, unhealthy): purge and stop it."""
        self.replicas.purge(replica_id, reason)

    # ---- lifecycle (also the autoscaler's backend interface) -----------------------------------
    @property
    def replica_ids(self) -> list[str]:
        return self.replicas.ids

    def note_frontdoor(self, frontdoor_id: str, num_unfinished: int) -> None:
        """A front door's accepted, unfinished requests (some not routed yet: replicas cannot count them)."""
        self._frontdoors[frontdoor_id] = (time.monotonic(), num_unfinished)

    @property
    def num_unfinished(self) -> int:
        """Requests in flight: what the replicas report (every front door's work), or what the
        front doors report if more (requests accepted but not yet on a replica)."""
        doors = self._door_unfinished()
        try:
            loads = self.shards.loads()
        except Exception:  # noqa: BLE001 - unknown while the service restarts
            return doors
        return max(doors, sum(load["requests"] for r, load in loads.items() if r in self.replicas.replicas))

    def _door_unfinished(self) -> int:
        horizon = time.monotonic() - 5.0
        return sum(n for t, n in self._frontdoors.values() if t >= horizon)

    def role_loads(self) -> dict[str, RoleLoad]:
        """With `cluster.pd`, each role's replicas and requests in flight (the autoscaler's signal;
        `ReplicaRoles.loads`): the replicas' reports, and the front doors' for what no replica has."""
        ids, doors = self.replicas.ids, self._door_unfinished()
        try:
            requests = {r: load["requests"] for r, load in self.shards.loads().items()}
        except Exception:  # noqa: BLE001 - unknown while the service restarts
            requests = None
        with self._lock:
            return self.roles.loads(ids, requests, doors)

    def add_replicas(self, n: int, role: str | None = None) -> list[str]:
        """Start `n` replicas on purpose (the count kept after a death grows by `n`); with
        `cluster.pd` and `role` (PREFILL or DECODE), each starts as one (None: `role_of`'s rule)."""
        cap = self.config.autoscaler.max_replicas if self.config.autoscaler is not None else None
        if cap is not None and len(self.replicas.replicas) + n > cap:
            raise RuntimeError(f"at most {cap} replicas (autoscaler.max_replicas)")
        if role is not None:
            with self._lock:  # refused before anything starts
                self.roles.check_add(role, self.replicas.ids, n, capped=cap is not None)
        ids = self._start_replicas(n, role)
        self.keeper.started(ids)
        return ids

    def _start_replica(self) -> str:
        """The restarter's replacement for a vacant slot."""
        (rid,) = self._start_replicas(1)
        return rid

    def _start_replicas(self, n: int, role: str | None = None) -> list[str]:
        """Start (as `role`, if given), register with the cache service, attach; then front doors
        see them (version)."""
        ids = self.replicas.add(n, before_listed=None if role is None else functools.partial(self._assign, role))
        try:
            self.shards.add(ids)
        except Exception:  # noqa: BLE001 - a restarted service learns them from their pushes
            pass
        try:
            ray.get([self.replicas.get(r).actor.attach_service.remote(self.shards.name_of(r), self.namespace)
                     for r in ids])
        except Exception as exc:
            for r in ids:  # died while starting: never left in the membership
                self.replicas.purge(r, f"failed to start ({type(exc).__name__})")
            raise
        self._pin(ids)
        self._changed()
        return ids

    def _pin(self, ids: list[str]) -> None:
        """Pin each replica to its role's CPUs (`cluster.pd.<role>_cpus`), else `cluster.replica_cpus`
        (neither set: nothing). Raises if a replica refuses (the CPUs are not online there): never
        left unpinned."""
        for rid in ids:
            with self._lock:
                role = self.roles.role_of(rid)
            cpus, rep = self.config.replica_cpu_list(role), self.replicas.get(rid)
            if cpus is not None and rep is not None:
                pinned = ray.get(rep.actor.pin_cpus.remote(cpus), timeout=60.0)
                log.info("%s (%s) pinned to CPUs %s", rid, role, list(pinned))

    def _assign(self, role: str, replica_id: str) -> None:
        with self._lock:
            self.roles.assign(replica_id, role)

    def remove_replica(self, replica_id: str, timeout_s: float = 60.0) -> None:
        """Drain: front doors stop routing to it; once it reports nothing in flight, stop it."""
        rep = self.replicas.get(replica_id)
        if rep is None:
            return
        self.keeper.removing(replica_id)  # not replaced, even if it dies while draining
        rep.draining = True
        self._changed()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                loads = self.shards.loads()
                if loads.get(replica_id, {}).get("requests", 0) == 0:
                    break
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.2)
        self.replicas.purge(replica_id, REMOVED)

    def _health_loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.replicas.check_health(self.config.health_max_missed, self.config.health_timeout_s)
            except Exception:  # noqa: BLE001 - keep checking
                log.exception("health check failed")

    # ---- transfers and warming ------------------------------------------------------------------
    def transfer(self, msg: TransferMsg) -> TransferResult:
        return self.transfers.move(list(msg.prompt_token_ids), msg.cache_salt, msg.src_replica,
                                   msg.dst_replica, msg.num_tokens, msg.kv_only)

    def hand_off(self, msg: HandoffMsg) -> HandoffResultMsg:
        """Hand a request held after its first token from its prefill replica to a decode replica
        (`control.handoffs`); the answer names the replica that decodes it now."""
        return self.handoffs.hand_off(msg)

    def note_hot(self, items: list[HotPrefixMsg]) -> None:
        self.hot.merge(items)

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        """Copy the hottest known prefixes onto `replica_id` from their holders; transfers done."""
        return self.warmer.warm(replica_id, limit)

    # ---- autoscaling (a front door may step it: tests) --------------------------------------------
    def autoscale_step(self):
        return self.autoscaler.step()

    def autoscale_history(self) -> list:
        return list(self.autoscaler.history) if self.autoscaler else []

    def stats(self) -> dict:
        return {"replica_deaths": self.replicas.num_deaths, "replica_restarts": self.keeper.num_restarts,
                "replica_restart_failures": self.keeper.num_failed_restarts, **self.transfers.counters,
                **self.handoffs.counters,
                "version": self._version, "num_replicas": len(self.replicas.replicas),
                "replica_slots": self.keeper.num_slots, "epoch": self.epoch, "restarted": self.restarted,
                "replicas_adopted": len(self.adopted)}

    def shutdown(self) -> None:
        self._stop.set()
        self.keeper.stop()
        self.replicas.shutdown()
        for shard in self.shards.handles:
            try:
                ray.kill(shard, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
