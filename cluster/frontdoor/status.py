"""The counts a front door reports (`ClusterBackend.counters`, `/metrics`): the controller's
(replica deaths, restarts, transfers), the cache service's resyncs summed across its restarts
(a restarted service counts from 0 again: its epoch changes), and this front door's routing and
retries. Reads are bounded: a busy or restarting actor gives the last known values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError


class DoorMetrics(Protocol):
    """What a front door records in the HTTP front end's metrics (`cluster.http.metrics.Metrics`)."""

    def record_route(self, policy: str, decision: str, reason: str | None = None) -> None: ...

    def record_transfer(self, ok: bool, seconds: float, num_bytes: int) -> None: ...

    def record_transfer_skipped(self) -> None: ...

    def attach_cluster_counters(self, read: Callable[[], dict]) -> None: ...


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
