"""A read replica of the cache service's routing state, held by a front door: decisions in process.

    service log --IndexOpsMsg--> IndexMirror.apply       (replays each op: same index, same loads)
    front door  --RouteRequestMsg--> IndexMirror.route   (the service's own `route`, here; no Ray call)
                <--RouteDecision--
    IndexMirror.take_booked() --note_routed--> service   (the load its decisions booked, for the others)

The mirror is a `CacheService` without a log, fed the service's ops in order from a snapshot:
the service is a deterministic state machine over its ops, so the mirror holds the index the
service held after the last op applied here (`tests/cache_service/test_index_mirror.py` checks
it routes as the service does). Decisions it makes book their load at once, here, and travel to
the service as `RoutedLoadOp`s tagged with this mirror's id; when they come back through the log
the mirror skips them (counted once). Other front doors' bookings arrive as ops.

Thread safety: one lock around every op applied and every decision, so a follower thread and
request threads may share a mirror. A mirror that lost its service (`invalidate`) routes nothing
until it loads a new snapshot.
"""

from __future__ import annotations

import contextlib
import threading
import zlib

from cache_service.messages import (
    IndexOpsMsg,
    IndexSnapshotMsg,
    RouteDecision,
    RoutedLoadOp,
    RouteRequestMsg,
)
from cache_service.router import NoReplicaError
from cache_service.service import CacheService
from cache_service.shards import route_over


class _OwnBookings:
    """Stands in for the mirror's log: keeps only the load its own decisions booked."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.ops: list[RoutedLoadOp] = []

    def append(self, op) -> None:
        if isinstance(op, RoutedLoadOp) and op.origin == self.origin:
            self.ops.append(op)


class IndexMirror:
    def __init__(self, mirror_id: str) -> None:
        self.mirror_id = mirror_id
        self.state: CacheService | None = None
        self.epoch: str | None = None  # the service instance followed (None: not ready)
        self.cursor = 0  # the seq of the next op to apply
        self.num_ops = 0
        self._own = _OwnBookings(mirror_id)
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.epoch is not None

    def load(self, snapshot: IndexSnapshotMsg) -> None:
        """Start over from the service's snapshot (first contact, a restarted service, or behind)."""
        spec = snapshot.spec
        state = CacheService(list(spec.groups), spec.eagle, spec.model_fingerprint, spec.policy,
                             spec.router_config, seed=zlib.crc32(self.mirror_id.encode()),
                             drop_rule=spec.drop_rule, keep_log=False)
        state.load_snapshot(snapshot)
        state.origin = self.mirror_id
        state.log = self._own
        with self._lock:
            self.state, self.epoch, self.cursor = state, snapshot.epoch, snapshot.seq

    def apply(self, msg: IndexOpsMsg) -> bool:
        """Replay the ops in `msg`. False (nothing applied): they are not the continuation of what
        this mirror holds (another service instance, ops it has not kept): load a snapshot."""
        if msg.behind or msg.epoch != self.epoch or msg.first_seq != self.cursor:
            return False
        for op in msg.ops:
            with self._lock:
                if msg.epoch != self.epoch:  # invalidated meanwhile
                    return False
                if not (isinstance(op, RoutedLoadOp) and op.origin == self.mirror_id):
                    self.state.replay(op)
                self.cursor += 1
                self.num_ops += 1
        return True

    def invalidate(self) -> None:
        """The service is unreachable or restarted: route nothing on what may be gone."""
        with self._lock:
            self.epoch = None

    def route(self, msg: RouteRequestMsg) -> RouteDecision:
        """The service's decision for `msg` on this replica's state. Raises `NoReplicaError` when
        not ready or no replica is known."""
        with self._lock:
            if self.epoch is None:
                raise NoReplicaError("the read replica of the index is not ready")
            return self.state.route(msg)

    def take_booked(self) -> list[RoutedLoadOp]:
        """The load this mirror's decisions booked since the last call (for `note_routed`)."""
        with self._lock:
            ops, self._own.ops = self._own.ops, []
            return ops


class ShardedMirror:
    """Read replicas of every shard of a sharded index (`shards.py`), one `IndexMirror` each (each
    followed by its own follower), routing over all of them as `shards.route_over` does; a
    decision's load is booked on the chosen replica's shard and told to that shard only."""

    def __init__(self, mirror_id: str, num_shards: int = 1) -> None:
        self.mirror_id = mirror_id
        self.shards = [IndexMirror(mirror_id) for _ in range(num_shards)]

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.shards)

    def route(self, msg: RouteRequestMsg) -> RouteDecision:
        """As the service(s) would decide. Raises `NoReplicaError` when a shard's replica is not
        ready or no replica is known."""
        if len(self.shards) == 1:
            return self.shards[0].route(msg)
        with contextlib.ExitStack() as held:
            for m in self.shards:  # always in shard order: no deadlock with another router thread
                held.enter_context(m._lock)
            if any(m.epoch is None for m in self.shards):
                raise NoReplicaError("a read replica of the index is not ready")
            return route_over([m.state for m in self.shards], msg)
