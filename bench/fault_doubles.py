"""Test doubles that inject faults (tests, `python -m bench.faults`), so production classes carry
no fault-injection methods:

    FaultyReplica     a replica whose event publisher can lose ("drop") or reorder ("reorder")
                      its next non-empty batch (`inject_event_fault(kind)`), and whose health
                      checks can stop answering (`stall_health_checks()`)
    kill_replica      kill a replica actor without telling anyone (the death is discovered)
    kill_cache_service  kill the cache service; Ray restarts it empty and replicas resync into it
"""

from __future__ import annotations

import logging
import time

import ray

from workers.event_publisher import EventPublisher
from workers.replica import TransferReplica

log = logging.getLogger(__name__)

EVENT_FAULTS = ("drop", "reorder")


class FaultyPublisher(EventPublisher):
    fault: str | None = None
    fired_s: float | None = None
    _held = None

    def transform(self, batch):
        if self._held is not None:  # reordered: the newer batch first, then the held one
            held, self._held = self._held, None
            super()._call("ingest", batch)
            return held
        if self.fault is None or not batch.records:
            return batch
        kind, self.fault, self.fired_s = self.fault, None, time.time()
        log.warning("fault injection: %s %s a batch of %d records", self.replica_id,
                    "dropped" if kind == "drop" else "held back", len(batch.records))
        if kind == "reorder":
            self._held = batch
        return None


class FaultyReplica(TransferReplica):
    def make_publisher(self, cls, service_name, namespace):
        return super().make_publisher(FaultyPublisher, service_name, namespace)

    @ray.method(concurrency_group="control")
    def inject_event_fault(self, kind: str) -> None:
        """Drop ("drop") or reorder ("reorder") the next non-empty event batch."""
        if kind not in EVENT_FAULTS:
            raise ValueError(f"event fault must be one of {EVENT_FAULTS}, got {kind!r}")
        self.publisher.fault, self.publisher.fired_s = kind, None

    @ray.method(concurrency_group="control")
    def stall_health_checks(self) -> None:
        """From now on `ping` never answers (a replica that stopped responding)."""
        self._stalled = True
        self.fault_fired_s = time.time()

    @ray.method(concurrency_group="control")
    def ping(self) -> str:
        while getattr(self, "_stalled", False):
            time.sleep(0.1)
        return super().ping()

    @ray.method(concurrency_group="control")
    def fault_time(self) -> float | None:
        times = [t for t in (self.fault_fired_s, self.publisher.fired_s) if t is not None]
        return max(times) if times else None


def kill_replica(backend, replica_id: str) -> None:
    """Kill the actor without telling anyone (the death is discovered by a stream or a health check)."""
    rep = backend.replicas.get(replica_id)
    if rep is not None:
        ray.kill(rep.actor, no_restart=True)


def kill_cache_service(backend) -> None:
    """Ray restarts it (empty); routing goes on by load; the replicas resync into it."""
    ray.kill(backend.service, no_restart=False)
