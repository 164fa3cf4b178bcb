"""The counts a front door reports (`ClusterBackend.counters`, `/metrics`): the controller's
(replica deaths, restarts, transfers), the cache service's resyncs summed across its restarts
(a restarted service counts from 0 again: its epoch changes), this front door's routing and
retries, and each replica's engine stats (`ReplicaEngineStats`: host tier pages, retained
checkpoints). Reads are bounded: a busy or restarting actor gives the last known values."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError

log = logging.getLogger(__name__)


class DoorMetrics(Protocol):
    """What a front door records in the HTTP front end's metrics (`cluster.http.metrics.Metrics`)."""

    def record_route(self, policy: str, decision: str, reason: str | None = None) -> None: ...

    def record_transfer(self, ok: bool, seconds: float, num_bytes: int) -> None: ...

    def record_transfer_skipped(self) -> None: ...

    def attach_cluster_counters(self, read: Callable[[], dict]) -> None: ...

    def attach_replica_engine_stats(self, read: Callable[[], dict[str, dict]]) -> None: ...


class ReplicaEngineStats:
    """Every replica's `engine_stats()`, asked of all at once and awaited at most `timeout_s`
    (a scrape must not hang on one busy replica): a replica that has not answered gives its last
    known values, one that left the membership (`MembershipView`) drops out."""

    def __init__(self, replicas, timeout_s: float = 2.0) -> None:
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._last: dict[str, dict] = {}

    def read(self) -> dict[str, dict]:
        """{replica id: its engine's stats}."""
        asked = {}
        for r, rep in list(self.replicas.replicas.items()):
            try:
                asked[r] = rep.actor.engine_stats.remote()
            except Exception:  # noqa: BLE001 - an actor that cannot be asked: no sample, /metrics still answers
                log.debug("engine stats of %s not asked", r, exc_info=True)
        refs = list(asked.values())
        done = set(ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)[0]) if refs else set()
        last = {r: v for r, v in self._last.items() if r in asked}
        for r, ref in asked.items():
            if ref in done:
                try:
                    last[r] = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead replica: its last values until it is purged
                    pass
        self._last = last
        return dict(last)


class ClusterStatus:
    def __init__(self, controller, service) -> None:
        self.controller = controller
        self.service = service
        self._controller_counters: dict = {}
        self._resyncs_seen = self._resyncs_before = 0  # as counted by the cache service (and its predecessors)
        self._service_epoch: str | None = None

    def controller_counters(self) -> dict:
        """The controller's counters; the last seen while it is busy."""
        try:
            self._controller_counters = ray.get(self.controller.stats.remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - busy or gone: the last known values
            pass
        return self._controller_counters

    def service_resyncs(self) -> int:
        try:
            stats = ray.get(self.service.stats.remote(), timeout=2.0)
            if stats["epoch"] != self._service_epoch:  # a restarted service counts from 0 again
                self._resyncs_before += self._resyncs_seen
                self._service_epoch = stats["epoch"]
            self._resyncs_seen = stats["resyncs"]
        except (RayActorError, GetTimeoutError):
            pass
        return self._resyncs_before + self._resyncs_seen

    def counters(self, routing_counters: dict, num_retries: int) -> dict:
        resyncs = self.service_resyncs()
        try:
            controller = ray.get(self.controller.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001
            controller = {}
        return {"replica_deaths": controller.get("replica_deaths", 0),
                "replica_restarts": controller.get("replica_restarts", 0), "transfers": controller.get("transfers", 0),
                "transfer_failures": controller.get("transfer_failures", 0), **routing_counters,
                "retries": num_retries, "service_resyncs": resyncs}
