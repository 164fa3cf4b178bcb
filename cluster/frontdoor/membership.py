"""A front door's copy of the controller's replica membership (handles, facts, draining).

Refreshed when the controller's version or epoch changes (polled, and at once after a failure),
so a purge, a new replica, a drain or a restarted controller's view reaches every front door.
This front door's own requests per replica (`num_inflight`) survive refreshes: they are its load
view while the service is down.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import ray

from workers.replica_messages import ReplicaInfoMsg

MEMBERSHIP_TIMEOUT_S = 30.0


@dataclass
class MemberReplica:
    """A replica as this front door sees it."""

    replica_id: str
    actor: object  # the replica's Ray actor handle
    info: ReplicaInfoMsg
    draining: bool = False  # routed no more (the controller waits for its requests, then stops it)
    num_inflight: int = 0  # this front door's requests on it
    role: str = "mixed"  # "prefill" | "decode" with `cluster.pd` (`control.replica_roles`)


class MembershipView:
    def __init__(self, controller) -> None:
        self.controller = controller
        self.version = -1
        self.epoch: str | None = None
        self.replicas: dict[str, MemberReplica] = {}
        self.service_name = ""
        self.num_shards = 1
        self.namespace = None
        self._lock = threading.RLock()
        self.refresh()

    def refresh(self) -> bool:
        """Fetch the membership; True if it changed."""
        msg = ray.get(self.controller.membership.remote(), timeout=MEMBERSHIP_TIMEOUT_S)
        with self._lock:
            if (msg.epoch, msg.version) == (self.epoch, self.version):
                return False
            old = self.replicas
            self.replicas = {e.replica_id: MemberReplica(e.replica_id, e.actor, e.info, draining=e.draining,
                                                         num_inflight=old[e.replica_id].num_inflight
                                                         if e.replica_id in old else 0, role=e.role)
                             for e in msg.replicas}
            self.version, self.epoch = msg.version, msg.epoch
            self.service_name, self.namespace = msg.service_name, msg.namespace
            self.num_shards = msg.num_shards
            return True

    def drop(self, replica_id: str) -> None:
        """Stop using `replica_id` here at once (the controller is told separately)."""
        with self._lock:
            self.replicas.pop(replica_id, None)

    def get(self, replica_id: str) -> MemberReplica | None:
        return self.replicas.get(replica_id)

    @property
    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self.replicas)
