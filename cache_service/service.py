"""The cluster-wide cache service (a Ray actor body): it owns the global index and routes.

    replicas   --ingest(EventBatchMsg)-->        once per engine step (events + the replica's load)
               <--IngestReplyMsg--               accepted, or "resync": a gap / this service does
                                                 not know the replica (it was restarted)
    replicas   --resync_chunk(ResyncChunkMsg)--> a chunked snapshot; routing goes on meanwhile,
                                                 the replica counted as hitting nothing
    front door --route(RouteRequestMsg)-->       one call, one pass over the chain for every
               <--RouteDecision--                replica: (replica, expected hit, transfer plan)

Nobody pulls in the request path: the index is exactly as fresh as the last pushed batch.
The service is a single-threaded actor, so one replica's pushes apply in the order sent.
"""

from __future__ import annotations

import uuid

from cache_service.coordinator import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.messages import EventBatchMsg, IngestReplyMsg, ResyncChunkMsg, RouteDecision, RouteRequestMsg
from cache_service.replica_load import LoadBook
from cache_service.router import NoReplicaError, Router, RouterConfig, RoutingPolicy
from cache_service.specs import CacheLayout, parse_group_spec


class CacheService:
    def __init__(self, groups: list[str], eagle: str, model_fingerprint: str, policy: str = "hybrid",
                 router_config: RouterConfig | None = None, seed: int | None = None,
                 drop_rule: str = "lookahead") -> None:
        """`drop_rule`: the replicas' engine setting, so routing predicts the hits they will find."""
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

    # ---- membership -----------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        """A new replica (empty cache, events from seq 0)."""
        self._purged.discard(replica_id)
        self.index.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> int:
        self._purged.add(replica_id)
        self.loads.forget(replica_id)
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
        self.counters["batches"] += 1
        self.counters["records"] += result.num_applied
        return IngestReplyMsg(not result.needs_resync, self.index.replicas[rid].next_seq, self.epoch)

    def resync_chunk(self, chunk: ResyncChunkMsg) -> IngestReplyMsg:
        rid = chunk.replica_id
        if rid in self._purged:
            return IngestReplyMsg(False, 0, self.epoch)
        if chunk.first:
            self.index.begin_resync(rid, chunk.resync_id)
        ok = self.index.resync_chunk(rid, chunk.resync_id, chunk.group_id, chunk.keys)
        if ok and chunk.last:
            ok = self.index.end_resync(rid, chunk.resync_id, chunk.next_seq)
            self.counters["resyncs"] += ok
        return IngestReplyMsg(ok, chunk.next_seq, self.epoch)

    def resync(self, replica_id: str, contents: list[list[bytes]], next_seq: int) -> None:
        """A whole snapshot in one call (tests, small caches)."""
        self._purged.discard(replica_id)
        self.index.resync(replica_id, contents, next_seq)

    # ---- routing (front doors) ------------------------------------------------------------
    def route(self, msg: RouteRequestMsg) -> RouteDecision:
        """The replica to serve `msg`, its expected hit and an optional transfer plan. Every
        replica is scored in one pass; load comes from the replicas' own reports plus what was
        routed to them since. Raises `NoReplicaError` when no replica is known."""
        candidates = self.index.replicas.keys()
        if msg.exclude:
            candidates = candidates - set(msg.exclude)
        if not candidates:
            raise NoReplicaError("no live replica known to the cache service")
        decision = self.router.route(msg.block_hashes, msg.num_prompt_tokens, self.loads.view(), candidates,
                                     msg.forced_replica)
        if not msg.dry_run:
            self.loads.add_pending(decision.replica_id, msg.num_prompt_tokens - decision.expected_hit_tokens
                                   + msg.num_output_tokens)
        self.counters["decisions"] += 1
        self.counters["load_only"] += decision.load_only
        return decision

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

    def ping(self) -> str:
        return self.epoch

    def stats(self) -> dict:
        return {"epoch": self.epoch, "num_entries": self.index.num_entries, **self.counters,
                "loads": self.loads.snapshot(), "replicas": {
                    r: {"stale": s.stale, "next_seq": s.next_seq, "entries": list(s.num_entries)}
                    for r, s in self.index.replicas.items()}}


__all__ = ["CacheService", "NoReplicaError"]
