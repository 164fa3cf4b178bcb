"""Who keeps a cluster's replica count after a death: exactly one of two.

    autoscaler configured    `ReplicaAutoscaler`: it owns the count (a death below min_replicas is
                             replaced by its BELOW_MIN rule); no restarter runs
    no autoscaler            `ReplicaRestarter`: a fixed count of slots, each dead replica replaced
                             (crash-loop backoff); replicas removed on purpose are not

Never both: one death would then start two replicas. The controller reports each replica
started, removed or purged here and nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.config import AutoscalerConfig, ReplicaRestartConfig
from cluster.control.autoscaler import ReplicaAutoscaler, ScalableReplicas
from cluster.control.replica_restarts import ReplicaRestarter

REMOVED = "removed"  # the purge reason of a replica removed on purpose (`ReplicaSet.purge`)


class ReplicaCountKeeper:
    def __init__(self, backend: ScalableReplicas, start_replica: Callable[[], str],
                 autoscaler: AutoscalerConfig | None, restart: ReplicaRestartConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`backend`: what the autoscaler drives; `start_replica()`: start one replica for a
        vacant slot (registered and routable) and return its id."""
        self.autoscaler = ReplicaAutoscaler(backend, autoscaler, clock) if autoscaler is not None else None
        self.restarter = ReplicaRestarter(start_replica, restart, clock) if autoscaler is None else None

    def started(self, replica_ids: list[str]) -> None:
        """Replicas started on purpose (initial, `add_replicas`, the autoscaler's)."""
        if self.restarter is not None:
            self.restarter.track(replica_ids)

    def removing(self, replica_id: str) -> None:
        """A removal on purpose begins (drain first): it is not replaced, even if it dies meanwhile."""
        if self.restarter is not None:
            self.restarter.release(replica_id)

    def purged(self, replica_id: str, reason: str) -> None:
        """`ReplicaSet.purge` stopped `replica_id` (`reason`: REMOVED, or why it was purged)."""
        if self.restarter is None:
            return  # the autoscaler sees the count drop on its next step
        if reason == REMOVED:
            self.restarter.release(replica_id)
        else:
            self.restarter.replica_failed(replica_id, reason)

    @property
    def num_slots(self) -> int | None:
        """The count kept after deaths (None: the autoscaler's bounds decide)."""
        return self.restarter.num_slots if self.restarter is not None else None

    @property
    def num_restarts(self) -> int:
        return self.restarter.num_restarts if self.restarter is not None else 0

    @property
    def num_failed_restarts(self) -> int:
        return self.restarter.num_failed_starts if self.restarter is not None else 0

    def start(self) -> None:
        for keeper in (self.autoscaler, self.restarter):
            if keeper is not None:
                keeper.start()

    def stop(self) -> None:
        for keeper in (self.autoscaler, self.restarter):
            if keeper is not None:
                keeper.stop()
