"""The cluster-wide cache service (a Ray actor body): it owns the global index and routes.

    replicas   --ingest(EventBatchMsg)-->        once per engine step (events + the replica's load)
               <--IngestReplyMsg--               accepted, or "resync": a gap / this service does
                                                 not know the replica (it was restarted)
    replicas   --resync_chunk(ResyncChunkMsg)--> a chunked snapshot; routing goes on meanwhile,
                                                 the replica counted as hitting nothing
    front door --route(RouteRequestMsg)-->       one call, one pass over the chain for every
               <--RouteDecision--                replica: (replica, expected hit, transfer plan)
    front door --follow(cursor)-->               the op log since `cursor` (`index_log.IndexLog`):
               <--IndexOpsMsg--                  a read replica of the index at the front door
               --note_routed(RoutedLoadOp...)--> (`index_mirror.IndexMirror`) routes in process and
                                                 books its decisions' load here for the others

Nobody pulls in the request path: the index is exactly as fresh as the last pushed batch (a read
replica: as the last op it followed). Every call that changes the routing state (membership,
events, resyncs, booked load) is applied on one thread, in order, and appended to the op log;
`replay` applies a logged op, so a `CacheService` replaying the log holds the same state.
"""

from __future__ import annotations

import pickle
import uuid

from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.index_log import IndexLog
from cache_service.messages import (
    EventBatchMsg,
    IndexOpsMsg,
    IndexSnapshotMsg,
    IngestReplyMsg,
    ReplicaMembershipOp,
    ResyncChunkMsg,
    RouteDecision,
    RoutedLoadOp,
    RouteRequestMsg,
    ServiceSpecMsg,
    WholeResyncOp,
)
from cache_service.replica_load import LoadBook
from cache_service.router import NoReplicaError, Router, RouterConfig, RoutingPolicy
from cache_service.shards import route_over
from cache_service.specs import CacheLayout, parse_group_spec


class CacheService:
    def __init__(self, groups: list[str], eagle: str, model_fingerprint: str, policy: str = "hybrid",
                 router_config: RouterConfig | None = None, seed: int | None = None,
                 drop_rule: str = "lookahead", keep_log: bool = True) -> None:
        """`drop_rule`: the replicas' engine setting, so routing predicts the hits they will find.
        `keep_log`: keep the op log read replicas follow (a read replica itself keeps none)."""
        self.spec = ServiceSpecMsg(tuple(groups), eagle, model_fingerprint, policy, router_config, drop_rule)
        self.origin = ""  # who books this service's decisions (a read replica: its id)
        self.layout = CacheLayout(tuple(parse_group_spec(g) for g in groups))
        self.coordinator = HybridCoordinator(self.layout, eagle, drop_rule=drop_rule)
        self.fingerprint = model_fingerprint
        self.index = GlobalIndex(len(self.layout.groups))
        self.epoch = uuid.uuid4().hex  # a new value after every (Ray) restart: state rebuilt from replicas
        self.router = Router(self.index, self.coordinator, RoutingPolicy(policy), router_config,
                             seed=seed if seed is not None else uuid.UUID(self.epoch).int % 2**32)
        self.loads = LoadBook()
        self._purged: set[str] = set()  # dead replicas: a late push must not bring them back
        self.counters = {"decisions": 0, "load_only": 0, "batches": 0, "records": 0, "resyncs": 0}
        self.log = IndexLog(self.epoch) if keep_log else None

    def _record(self, op) -> None:
        if self.log is not None:
            self.log.append(op)

    # ---- membership -----------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        """A new replica (empty cache, events from seq 0)."""
        self._purged.discard(replica_id)
        self.index.add_replica(replica_id)
        self.loads.ensure(replica_id)
        self._record(ReplicaMembershipOp(replica_id, True))

    def remove_replica(self, replica_id: str) -> int:
        self._purged.add(replica_id)
        self.loads.forget(replica_id)
        self._record(ReplicaMembershipOp(replica_id, False))
        return self.index.purge(replica_id)

    # ---- events (pushed by replicas) ------------------------------------------------------
    def ingest(self, batch: EventBatchMsg) -> IngestReplyMsg:
        """Apply one pushed batch. `accepted=False` asks the replica for a chunked resync."""
        rid = batch.replica_id
        if rid in self._purged:
            return IngestReplyMsg(False, 0, self.epoch)
        self.loads.report(rid, batch.load)
        if rid not in self.index.replicas:  # this service never saw it: only a fresh replica can start
            self.index.add_replica(rid, stale=batch.first_seq != 0)
        result = self.index.apply_batch(rid, batch.first_seq, batch.end_seq, batch.records)
        self._record(batch)
        self.counters["batches"] += 1
        self.counters["records"] += result.num_applied
        return IngestReplyMsg(not result.needs_resync, self.index.replicas[rid].next_seq, self.epoch)

    def resync_chunk(self, chunk: ResyncChunkMsg) -> IngestReplyMsg:
        rid = chunk.replica_id
        if rid in self._purged:
            return IngestReplyMsg(False, 0, self.epoch)
        self._record(chunk)
        if chunk.first:
            self.index.begin_resync(rid, chunk.resync_id)
            self.loads.ensure(rid)
        ok = self.index.resync_chunk(rid, chunk.resync_id, chunk.group_id, chunk.keys, chunk.host)
        if ok and chunk.last:
            ok = self.index.end_resync(rid, chunk.resync_id, chunk.next_seq)
            self.counters["resyncs"] += ok
        return IngestReplyMsg(ok, chunk.next_seq, self.epoch)

    def resync(self, replica_id: str, contents: list[list[bytes]], next_seq: int) -> None:
        """A whole snapshot in one call (tests, small caches)."""
        self._purged.discard(replica_id)
        self.index.resync(replica_id, contents, next_seq)
        self.loads.ensure(replica_id)
        self._record(WholeResyncOp(replica_id, tuple(tuple(keys) for keys in contents), next_seq))

    # ---- routing (front doors) ------------------------------------------------------------
    def route(self, msg: RouteRequestMsg) -> RouteDecision:
        """The replica to serve `msg`, its expected hit and an optional transfer plan. Every
        replica is scored in one pass; load comes from the replicas' own reports plus what was
        routed to them since. Raises `NoReplicaError` when no replica is known."""
        return route_over([self], msg)

    def route_many(self, msgs: list[RouteRequestMsg]) -> list[RouteDecision | None]:
        """`route` for a batch a front door collected while its previous calls were in flight
        (one Ray call's overhead for all of them). None where no replica is known."""
        out = []
        for msg in msgs:
            try:
                out.append(self.route(msg))
            except NoReplicaError:
                out.append(None)
        return out

    def book(self, op: RoutedLoadOp) -> None:
        """Count a decision's work on its replica until the replica's own report includes it."""
        self.loads.add_pending(op.replica_id, op.tokens)
        self._record(op)

    def note_routed(self, ops: list[RoutedLoadOp]) -> None:
        """Decisions a read replica made (it booked them itself): the service and the other read
        replicas count them too. Unknown (purged) replicas are ignored."""
        for op in ops:
            if op.replica_id in self.index.replicas:
                self.book(op)

    # ---- read replicas (front doors) ---------------------------------------------------------
    can_wait = False  # `follow` may wait for an op (the Ray actor: a concurrency group of its own)

    def follow(self, cursor: int, wait_s: float = 0.0) -> IndexOpsMsg:
        """The logged ops from `cursor` on. Here it never waits (`wait_s` ignored: a wait would
        block the one thread); `cluster.control.service_actor` waits up to `wait_s` for one."""
        return self.log.since(cursor)

    def snapshot(self) -> IndexSnapshotMsg:
        """The whole routing state and the log position it stands at (on the writer thread, so
        consistent with the log). Pending load travels as ages, not this process's clock."""
        now = self.loads.clock()
        loads = {r: (load.report, [(now - t, n) for t, n in load.pending])
                 for r, load in self.loads._loads.items()}
        state = (self.index.holders, self.index.replicas, self.index.by_bit, self._purged, loads)
        return IndexSnapshotMsg(self.epoch, self.log.end_seq, self.spec, pickle.dumps(state, protocol=5))

    def load_snapshot(self, msg: IndexSnapshotMsg) -> None:
        """Become the state `msg` holds (a read replica catching up from scratch)."""
        holders, replicas, by_bit, purged, loads = pickle.loads(msg.state)
        self.index.holders[:] = holders
        self.index.replicas.clear()
        self.index.replicas.update(replicas)
        self.index.by_bit.clear()
        self.index.by_bit.update(by_bit)
        self.index._routable = None
        self._purged = set(purged)
        now = self.loads.clock()
        self.loads = type(self.loads)(self.loads.pending_ttl_s, self.loads.clock)
        for r, (report, pending) in loads.items():
            self.loads.report(r, report)
            for age, n in pending:
                self.loads.add_pending(r, n, at=now - age)

    def replay(self, op) -> None:
        """Apply one op of another service's log (a read replica following it)."""
        if isinstance(op, EventBatchMsg):
            self.ingest(op)
        elif isinstance(op, ResyncChunkMsg):
            self.resync_chunk(op)
        elif isinstance(op, RoutedLoadOp):
            self.book(op)
        elif isinstance(op, ReplicaMembershipOp):
            (self.add_replica if op.added else self.remove_replica)(op.replica_id)
        elif isinstance(op, WholeResyncOp):
            self.resync(op.replica_id, [list(keys) for keys in op.contents], op.next_seq)
        else:
            raise TypeError(f"not an op of the cache service's log: {type(op).__name__}")

    def ping(self) -> str:
        return self.epoch

    def stats(self) -> dict:
        return {"epoch": self.epoch, "num_entries": self.index.num_entries, **self.counters,
                "log_end_seq": self.log.end_seq if self.log is not None else 0,
                "loads": self.loads.snapshot(), "replicas": {
                    r: {"stale": s.stale, "next_seq": s.next_seq, "entries": list(s.num_entries)}
                    for r, s in self.index.replicas.items()}}


__all__ = ["CacheService", "NoReplicaError"]
