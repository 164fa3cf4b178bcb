"""Test doubles that inject faults (tests, `python -m bench.faults`), so production classes carry
no fault-injection methods:

    FaultyReplica     a replica whose event publisher can lose ("drop") or reorder ("reorder")
                      its next non-empty batch (`inject_event_fault(kind)`), whose next sent
                      prefix can be corrupted (`inject_transfer_fault()`), which can evict its
                      whole cache (`evict_cached()`), whose health checks can stop answering
                      (`stall_health_checks()`) and whose engine loop's next step can raise
                      (`inject_loop_fault()`)
    kill_replica      kill a replica actor without telling anyone (the death is discovered)
    kill_cache_service  kill the cache service; Ray restarts it empty and replicas resync into it
    kill_controller   kill the controller; Ray restarts it and it adopts the running replicas
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
    fault_fired_s: float | None = None  # time.time() when an injected fault took effect
    _corrupt_next_send = False
    _stalled = False

    def make_publisher(self, cls, service_name, namespace):
        return super().make_publisher(FaultyPublisher, service_name, namespace)

    @ray.method(concurrency_group="control")
    def inject_transfer_fault(self) -> None:
        """Flip one byte of the next prefix this replica sends (after its checksum)."""
        self._corrupt_next_send = True

    def corrupt_this_send(self) -> bool:
        corrupt, self._corrupt_next_send = self._corrupt_next_send, False
        if corrupt:
            self.fault_fired_s = time.time()
        return corrupt

    @ray.method(concurrency_group="control")
    def evict_cached(self) -> int:
        """Evict every cached page not in use right now (as memory pressure would). Returns how many."""
        def evict(engine):
            return sum(pool.evict(key) for pool in engine.cache.pools for key in list(pool.cached))

        n = self.runner.call(evict)
        self.fault_fired_s = time.time()
        return n

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
        while self._stalled:
            time.sleep(0.1)
        return super().ping()

    @ray.method(concurrency_group="control")
    def inject_loop_fault(self) -> None:
        """The engine loop's next step raises (as a bug in the engine would): the supervised loop
        stops, the replica reports itself unhealthy and its requests are retried elsewhere."""
        def broken_step():
            self.fault_fired_s = time.time()
            raise RuntimeError("injected engine-loop fault")

        self.runner.call(lambda engine: setattr(engine, "step", broken_step))

    @ray.method(concurrency_group="control")
    def loop_health(self) -> str | None:
        """The engine runner's own verdict (the replica's `health()` caches it once broken)."""
        return self.runner.health()

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


def kill_controller(backend) -> None:
    """Ray restarts it; the restarted controller adopts the replicas and the cache service."""
    ray.kill(backend.controller, no_restart=False)


class HandoffCorruptingReplica(TransferReplica):
    """A replica whose prefill/decode hand-offs of request ids starting with "corrupt-" flip a byte
    on the wire (after the checksum): the decoder refuses the package and this replica keeps the
    request (`workers.handoff_replica`)."""

    def corrupt_this_handoff(self, meta) -> bool:
        return meta.request_id.startswith("corrupt-")
