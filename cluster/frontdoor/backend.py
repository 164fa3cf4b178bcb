"""A front door onto the cluster: it implements the HTTP front end's `Backend` protocol
(`cluster.http.backend`). Several front doors may serve one cluster; each composes one object
per concept:

    controller      (control/controller.py, a detached named actor: found, or started by the first
                    front door, `control/controller_handle.py`) replica lifecycle, health,
                    autoscaling, warm-up, transfers
    MembershipView  (membership.py)      the replicas' handles, refreshed from the controller
    PlacementMixin  (placement.py)       where an attempt runs: route, reserve, move pages first;
                                         with `cluster.pd` the decode leg too
    RoutingClient   (routing_client.py)  decides on this front door's read replica of the index
                                         (or one cache-service call per batch); by load while the
                                         service is down
    request_streams (request_streams.py) serving one request: retries, outputs, no token twice
    HotPrefixes     (hot_prefixes.py)    the prompts served, handed to the controller for warming
    ClusterStatus   (status.py)          the controller's, the service's and this door's counts
                                         (and each replica's engine stats, for /metrics)

    submit(request)                                   (returns at once; a worker thread serves it)
      0. hash the prompt, once (the replica's engine adopts the hashes)
      1. route: one call to the cache service (no lock, no pull); if the plan says the holder is
         busy, the controller moves its pages to the chosen replica first, where the link measured
         beats recomputing them (`page_mover.py`; recompute on failure)
      2. stream the replica's outputs into the request's stream
      3. the replica died or reports itself unhealthy: the controller purges (stops) it, the
         request is served elsewhere; tokens the caller already has are not sent twice (greedy and
         seeded outputs are deterministic; an unseeded sampled request that had already streamed
         fails with a retryable error)
      4. the cache service is down: route by load until Ray has restarted it; every replica then
         resyncs into it by itself (its next push is refused)
      pd. with `cluster.pd`: step 1 routes among the prefill replicas only; after the first token
         the controller hands the request to the decode replica with the fewest of this front
         door's requests (`decode_handoffs.py`) and the rest streams from it (`request_streams.py`)
      5. the controller is down (Ray restarts it; it adopts the running replicas): requests stream
         on from the replicas; a transfer asked of it recomputes, a failure report is left to its
         health checks, and the membership is fetched again once it answers (a new epoch)

Verification (tests, `python -m bench.faults`): `index_problems()` lists where the service's
index differs from the live replicas' caches. Faults are injected through test doubles
(`bench.fault_doubles`), not through methods here.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import ray

from cache_service.router import RouterConfig
from cluster.config import ClusterConfig
from cluster.control.controller_handle import AutoscalerProxy, attach_or_start, stop_controller, wait_until_ready
from cluster.frontdoor.decode_handoffs import DecodeHandoffs
from cluster.frontdoor.hot_prefixes import HotPrefixes
from cluster.frontdoor.index_check import index_problems
from cluster.frontdoor.membership import MemberReplica, MembershipView
from cluster.frontdoor.page_mover import PageMover
from cluster.frontdoor.placement import PlacementMixin
from cluster.frontdoor.request_streams import Job, ReplicaFailedError, serve_request
from cluster.frontdoor.routing_client import RoutingClient
from cluster.frontdoor.status import ClusterStatus, DoorMetrics, ReplicaEngineStats
from cluster.ids import new_cluster_name, new_frontdoor_id, new_request_id
from workers.engine.errors import InvalidRequestError, ServerOverloadedError, validate_prompt
from workers.engine.request import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine_runner import RequestStream
from workers.replica import TransferReplica
from workers.replica_messages import GenerateMsg

log = logging.getLogger(__name__)

SERVICE_TIMEOUT_S = 10.0
MEMBERSHIP_INTERVAL_S = 0.5

__all__ = ["ClusterBackend", "ReplicaFailedError"]


class ClusterBackend(PlacementMixin):
    def __init__(self, model_dir: str, engine_config, config: ClusterConfig | None = None,
                 router: RouterConfig | None = None, replica_cls: type = TransferReplica) -> None:
        """Attach to the cluster named `config.name` if its controller runs; else start it (a
        detached controller: it outlives this front door until `shutdown(stop_cluster=True)`).
        `config` None: one replica, a cluster of its own (a fresh name)."""
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.config = config or ClusterConfig(name=None)
        self.router = router or RouterConfig()
        self.name = self.config.name or new_cluster_name()
        self.namespace = ray.get_runtime_context().namespace
        self.controller, self.owns_cluster = attach_or_start(self.name, self.namespace, model_dir, engine_config,
                                                             self.config, self.router, replica_cls)
        wait_until_ready(self.controller)
        self.replicas = MembershipView(self.controller)
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_inflight, thread_name_prefix="request")
        self.metrics: DoorMetrics | None = None
        self.num_retries = 0
        first = next(iter(self.replicas.replicas.values())).info
        self.limits = {"vocab_size": first.vocab_size, "max_model_len": first.max_model_len,
                       "alignment": first.alignment}
        self.service_name = self.replicas.service_name
        self.service = ray.get_actor(self.service_name, namespace=self.namespace)
        self.status = ClusterStatus(self.controller, self.service)
        self.frontdoor_id = new_frontdoor_id()
        self.routing = RoutingClient(self.service_name, self.namespace, first.hash_block_size, first.fingerprint,
                                     read_replica=self.config.cache_service.read_replica, client_id=self.frontdoor_id,
                                     num_shards=self.replicas.num_shards)
        self.mover = PageMover(self.controller, self.replicas, self.router.links)
        self.handoffs = DecodeHandoffs(self.replicas, self._lock, self.routing)
        self.hot = HotPrefixes(first.alignment, self.config.hot_prefixes)
        self.autoscaler = (AutoscalerProxy(self.controller, self._report_unfinished, self.replicas.refresh)
                           if self.config.autoscaler is not None else None)
        self._stop = threading.Event()
        threading.Thread(target=self._follow_controller, name="membership", daemon=True).start()

    def _follow_controller(self) -> None:
        """Refresh the membership and hand this front door's hot prefixes to the controller."""
        while not self._stop.wait(MEMBERSHIP_INTERVAL_S):
            try:
                self.replicas.refresh()
                self.controller.note_hot.remote(self.hot.items())
                self.controller.note_frontdoor.remote(self.frontdoor_id, self.num_unfinished)
            except Exception:  # noqa: BLE001 - the controller is busy or gone: keep serving what we know
                log.debug("membership refresh failed", exc_info=True)

    def _report_unfinished(self) -> None:
        """Before an autoscaling step: this front door's load and hot prefixes, as of now."""
        ray.get([self.controller.note_frontdoor.remote(self.frontdoor_id, self.num_unfinished),
                 self.controller.note_hot.remote(self.hot.items())])

    # ---- replicas (the controller does it; these wait for it) ---------------------------------------
    def add_replicas(self, n: int, role: str | None = None) -> list[str]:
        """Start `n` replicas (in parallel) and wait until they serve; with `cluster.pd`, as `role`."""
        ids = ray.get(self.controller.add_replicas.remote(n, role))
        self.replicas.refresh()
        return ids

    def remove_replica(self, replica_id: str, timeout_s: float = 60.0) -> None:
        """Drain (no new requests), wait for its requests to finish, then stop it."""
        ray.get(self.controller.remove_replica.remote(replica_id, timeout_s))
        self.replicas.refresh()

    def purge(self, replica_id: str, reason: str) -> None:
        self.replicas.drop(replica_id)
        try:
            ray.get(self.controller.report_failure.remote(replica_id, reason), timeout=60)
        except Exception:  # noqa: BLE001 - the controller's health checks find it anyway
            log.warning("could not report %s to the controller", replica_id)

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        """Copy the hottest known prefixes onto `replica_id` from their holders. Returns transfers done."""
        ray.get(self.controller.note_hot.remote(self.hot.items()))
        return ray.get(self.controller.warm.remote(replica_id, limit))

    @property
    def replica_ids(self) -> list[str]:
        return self.replicas.ids
    # ---- the EngineRunner interface -------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._jobs)

    @property
    def max_model_len(self) -> int:
        return self.limits["max_model_len"]

    def attach_metrics(self, metrics: DoorMetrics) -> None:
        self.metrics = metrics
        metrics.attach_cluster_counters(self.status.controller_counters)
        metrics.attach_replica_engine_stats(ReplicaEngineStats(self.replicas).read)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None, replica_id: str | None = None) -> RequestStream:
        """Validate and accept; raises `InvalidRequestError` or `ServerOverloadedError` at once."""
        return self._accept(prompt_token_ids, params, cache_salt, request_id, replica_id).stream

    def _accept(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None,
                request_id: str | None, replica_id: str | None) -> Job:
        """The prompt is hashed here, once: the cache service routes by these hashes and the
        replica's engine adopts them."""
        prompt = tuple(prompt_token_ids)
        validate_prompt(prompt, self.limits["vocab_size"], self.limits["max_model_len"])
        with self._lock:
            if len(self._jobs) >= self.config.max_inflight:
                raise ServerOverloadedError(f"{len(self._jobs)} requests in flight (max {self.config.max_inflight})",
                                            retry_after_s=1.0)
            rid = request_id or new_request_id()
            if rid in self._jobs:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            msg = GenerateMsg(rid, prompt, params, cache_salt, self.routing.hashes(prompt, cache_salt))
            job = Job(msg, RequestStream(rid), replica_id)
            self._jobs[rid] = job
        self._pool.submit(self._serve, job)
        return job

    def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            return
        job.cancelled = True
        rep = self.replicas.get(job.replica_id or "")
        if rep is not None:
            rep.actor.abort.remote(request_id)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                 replica_id: str | None = None) -> tuple[RequestOutput, str]:
        """Blocking convenience (tests, tools): the finished output and the replica that served it."""
        job = self._accept(prompt_token_ids, params, cache_salt, None, replica_id)
        outputs = list(job.stream)
        return outputs[-1], job.served_by

    def _serve(self, job: Job) -> None:
        try:
            serve_request(self, job)
        finally:
            with self._lock:
                self._jobs.pop(job.msg.request_id, None)

    # ---- serving one request (request_streams.FrontDoor) ---------------------------------------
    @property
    def max_attempts(self) -> int:
        return self.config.max_attempts

    def replica(self, replica_id: str) -> MemberReplica | None:
        return self.replicas.get(replica_id)

    def count_retry(self) -> None:
        with self._lock:
            self.num_retries += 1

    def finished(self, job: Job, output: RequestOutput) -> None:
        self.hot.remember(job.msg.prompt_token_ids, job.msg.cache_salt)
        self.mover.observe_output(job.prefilled_by or job.served_by, output)  # the prefill's speed

    # ---- status ---------------------------------------------------------------------------------
    @property
    def counters(self) -> dict:
        """Routing, transfer, failure and resync counts (`frontdoor.status`)."""
        return {**self.status.counters(self.routing.counters, self.num_retries), **self.mover.counters}

    def stats(self) -> dict:
        with self._lock:
            reps = {r: {"inflight": rep.num_inflight, "draining": rep.draining, "node_id": rep.info.node_id}
                    for r, rep in self.replicas.replicas.items()}
        return {"replicas": reps, "inflight": len(self._jobs), **self.counters, **self.mover.links.snapshot()}

    def service_stats(self) -> dict:
        return ray.get(self.service.stats.remote(), timeout=SERVICE_TIMEOUT_S)

    def index_problems(self) -> list[str]:
        """Where the cache service's index differs from the live replicas' caches (empty: consistent);
        see `cluster.frontdoor.index_check`."""
        shards = [self.routing.shard(k) for k in range(self.routing.num_shards)]
        mirrors = self.routing.mirror.shards if self.routing.mirror is not None else None
        return index_problems(self.replicas, shards, mirrors)

    def shutdown(self, stop_cluster: bool | None = None) -> None:
        """Stop this front door (its requests are aborted); with `stop_cluster` (default: if this
        front door started the cluster) also the controller, the replicas and the cache service."""
        self._stop.set()
        self.routing.close()
        for job in list(self._jobs.values()):
            self.abort(job.msg.request_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if stop_cluster if stop_cluster is not None else self.owns_cluster:
            stop_controller(self.controller)
