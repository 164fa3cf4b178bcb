"""The cluster behind the HTTP front end: replica actors, the cache-service actor, routing,
transfers, retries, backpressure. It has the `EngineRunner` interface the front end drives
(`submit(prompt, params, cache_salt) -> RequestStream`, `abort`, `num_unfinished`).

    submit(request)                                   (returns at once; a worker thread serves it)
      1. pull every replica's cache events into the cache service (resync on a gap, or when the
         service was restarted and lost its index)
      2. route: the replica whose reconciled hybrid hit + queued work is cheapest; if the plan
         says the holder is busy, its pages move to the chosen replica first (recompute on any
         transfer failure, with the reason logged)
      3. stream the replica's outputs into the request's stream
      4. the replica died: purge it from the index and serve the request elsewhere; tokens the
         caller already has are not sent twice (greedy and seeded outputs are deterministic; an
         unseeded sampled request that had already streamed fails with a retryable error)
      5. the cache service is down: route by load alone until Ray has restarted it
      6. a replica reports itself unhealthy (a TP rank died): it is purged, stopped, and the
         request is served elsewhere, as in 4

Verification and fault injection (tests, `python -m bench.faults`): `index_problems()` lists
where the cache service's index differs from the live replicas' caches; `on_routed` is called
between routing a request and moving pages / serving it; `kill_replica`, `kill_cache_service`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cache_service.router import NoReplicaError, RouteDecision, RouterConfig
from cache_service.service import CacheService
from workers.engine.errors import InvalidRequestError, ServerOverloadedError, validate_prompt
from workers.engine.request import RequestOutput
from workers.engine.sampling import SamplingParams
from workers.engine_runner import RequestStream, StreamEnd
from workers.replica import GenerateMsg, ReplicaUnhealthyError, TransferReplica

log = logging.getLogger(__name__)

SERVICE_TIMEOUT_S = 10.0
_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(RequestOutput)}


class ReplicaFailedError(ServerOverloadedError):
    """The replica serving a request died and the request cannot be resumed elsewhere; retryable
    (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s)


class _StreamBroken(RuntimeError):
    """A replica's stream ended without a finished output."""


@dataclass(frozen=True)
class BackendConfig:
    num_replicas: int = 1
    tp_size: int = 1
    distributed_backend: str = "gloo"
    policy: str = "hybrid"
    router: RouterConfig = field(default_factory=RouterConfig)
    max_inflight: int = 256  # accepted, unfinished requests; beyond: 429
    max_attempts: int = 3  # replicas tried per request
    replica_num_cpus: float = 0.0
    replica_num_gpus: float = 0.0
    replica_max_concurrency: int = 64
    hot_prefixes: int = 32  # remembered for warming new replicas
    transfer_timeout_s: float = 120.0
    sync_interval_s: float = 1.0  # events pulled at least this often, traffic or not (0: only when routing)


@dataclass
class _Replica:
    replica_id: str
    actor: object
    info: dict
    queued_tokens: int = 0
    num_inflight: int = 0
    draining: bool = False
    next_seq: int = 0  # the seq after the last event handed to the cache service


@dataclass
class _Job:
    msg: GenerateMsg
    stream: RequestStream
    forced: str | None
    cancelled: bool = False
    replica_id: str | None = None
    report_replica: bool = False  # `generate` wants to know who served it


class ClusterBackend:
    def __init__(self, model_dir: str, engine_config, config: BackendConfig | None = None) -> None:
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.config = config or BackendConfig()
        self._replica_cls = ray.remote(TransferReplica)
        self._replica_options = dict(
            num_cpus=self.config.replica_num_cpus, num_gpus=self.config.replica_num_gpus, max_restarts=0,
            max_concurrency=self.config.replica_max_concurrency)
        self._secret = secrets.token_hex(16)
        self._lock = threading.RLock()  # replicas, loads, jobs
        self._route_lock = threading.Lock()  # event sync + routing decisions, one at a time
        self.replicas: dict[str, _Replica] = {}
        self._ids = itertools.count()
        self._jobs: dict[str, _Job] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_inflight, thread_name_prefix="request")
        self._pair_locks: dict[tuple[str, str], threading.Lock] = {}
        self._hot: OrderedDict[tuple, int] = OrderedDict()  # (prompt prefix, salt) -> hit tokens seen
        self.metrics = None
        self._channel_gen: dict[tuple[str, str], int] = {}  # (src, dst) -> channel generation
        self._served_by: dict[str, str] = {}  # request id -> replica, for `generate`
        self.counters = {"routed": 0, "load_only": 0, "transfers": 0, "transfer_failures": 0, "retries": 0,
                         "replica_deaths": 0, "service_resyncs": 0}
        self.limits: dict = {}
        self.on_routed = None  # fault injection: fn(msg, decision or None, target) before transfer / serve
        self.add_replicas(self.config.num_replicas)
        first = next(iter(self.replicas.values())).info
        self.limits = {k: first[k] for k in ("vocab_size", "max_model_len", "alignment")}
        self._service_args = (first["groups"], first["eagle"], first["fingerprint"], self.config.policy,
                              self.config.router)
        self.service = ray.remote(CacheService).options(num_cpus=0, max_restarts=-1, max_task_retries=0).remote(
            *self._service_args)
        with self._route_lock:
            self._sync()
        self._stop = threading.Event()
        if self.config.sync_interval_s > 0:  # deaths, lost batches, a restarted service: found without traffic
            threading.Thread(target=self._sync_loop, name="index-sync", daemon=True).start()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.config.sync_interval_s):
            try:
                with self._route_lock:
                    self._sync()
            except (RayActorError, GetTimeoutError):
                pass  # the cache service is down: the next round rebuilds it
            except Exception:  # noqa: BLE001 - keep syncing
                log.exception("index sync failed")

    # ---- replicas -----------------------------------------------------------------------------
    def add_replicas(self, n: int) -> list[str]:
        """Start `n` replicas (in parallel) and wait until they serve."""
        ids = [f"replica-{next(self._ids)}" for _ in range(n)]
        placement = self._spread(n)
        actors = {rid: self._replica_cls.options(**self._replica_options, scheduling_strategy=strategy).remote(
                      rid, self.model_dir, self.engine_config, self.config.tp_size, self.config.distributed_backend)
                  for rid, strategy in zip(ids, placement)}
        ray.get([a.set_transfer_secret.remote(self._secret) for a in actors.values()])
        infos = ray.get([a.describe.remote() for a in actors.values()])
        with self._lock:
            for (rid, actor), info in zip(actors.items(), infos):
                if self.limits and info["fingerprint"] != self._service_args[2]:
                    ray.kill(actor, no_restart=True)
                    raise RuntimeError(f"{rid} loaded a different model ({info['fingerprint']})")
                self.replicas[rid] = _Replica(rid, actor, info)
        log.info("replicas up: %s", ", ".join(f"{i['replica_id']}@{i['node_id'][:8]}" for i in infos))
        return ids

    def _spread(self, n: int) -> list:
        """One scheduling strategy per new replica: the alive nodes that have the replica's
        resources and hold the fewest replicas first (node affinity; Ray's soft affinity and
        SPREAD were seen stacking replicas on one node while another was idle)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cpus, gpus = self.config.replica_num_cpus, self.config.replica_num_gpus
        nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")
                 and node.get("Resources", {}).get("CPU", 0) >= cpus
                 and node.get("Resources", {}).get("GPU", 0) >= gpus]
        if len(nodes) < 2:
            return ["SPREAD"] * n
        with self._lock:
            count = {node: 0 for node in nodes}
            for rep in self.replicas.values():
                if rep.info["node_id"] in count:
                    count[rep.info["node_id"]] += 1
        out = []
        for _ in range(n):
            node = min(nodes, key=lambda x: (count[x], nodes.index(x)))
            count[node] += 1
            out.append(NodeAffinitySchedulingStrategy(node, soft=False))
        return out

    def remove_replica(self, replica_id: str, timeout_s: float = 60.0) -> None:
        """Drain (no new requests), wait for its requests to finish, then stop it."""
        with self._lock:
            rep = self.replicas.get(replica_id)
            if rep is None:
                return
            rep.draining = True
        deadline = time.monotonic() + timeout_s
        while rep.num_inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        self._forget(replica_id, reason="removed")
        ray.kill(rep.actor, no_restart=True)

    def kill_replica(self, replica_id: str) -> None:
        """Fault injection: kill the actor without telling anyone (the death is discovered)."""
        rep = self.replicas.get(replica_id)
        if rep is not None:
            ray.kill(rep.actor, no_restart=True)

    def kill_cache_service(self) -> None:
        """Fault injection: kill the cache service; Ray restarts it (empty), we rebuild its index."""
        ray.kill(self.service, no_restart=False)

    def _forget(self, replica_id: str, reason: str, stop: bool = False) -> None:
        with self._lock:
            rep = self.replicas.pop(replica_id, None)
        if rep is None:
            return
        if reason != "removed":
            self.counters["replica_deaths"] += 1
        log.warning("replica %s %s: purging it from the index", replica_id, reason)
        if stop:  # alive but unusable (e.g. a TP rank died): free what it holds
            ray.kill(rep.actor, no_restart=True)
        try:
            ray.get(self.service.remove_replica.remote(replica_id), timeout=SERVICE_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            pass  # the service is down; it rebuilds from the live replicas when back
        for other in list(self.replicas.values()):
            other.actor.drop_channel.remote(replica_id)

    @property
    def replica_ids(self) -> list[str]:
        with self._lock:
            return sorted(self.replicas)

    # ---- the EngineRunner interface -------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._jobs)

    @property
    def max_model_len(self) -> int:
        return self.limits["max_model_len"]

    def attach_metrics(self, metrics) -> None:
        self.metrics = metrics

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None, replica_id: str | None = None, _report: bool = False) -> RequestStream:
        """Validate and accept; raises `InvalidRequestError` or `ServerOverloadedError` at once."""
        prompt = list(prompt_token_ids)
        validate_prompt(prompt, self.limits["vocab_size"], self.limits["max_model_len"])
        with self._lock:
            if len(self._jobs) >= self.config.max_inflight:
                raise ServerOverloadedError(f"{len(self._jobs)} requests in flight (max {self.config.max_inflight})",
                                            retry_after_s=1.0)
            rid = request_id or f"req-{secrets.token_hex(8)}"
            if rid in self._jobs:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            job = _Job(GenerateMsg.of(prompt, params, cache_salt, rid), RequestStream(rid), replica_id,
                       report_replica=_report)
            self._jobs[rid] = job
        self._pool.submit(self._serve, job)
        return job.stream

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
        stream = self.submit(prompt_token_ids, params, cache_salt, replica_id=replica_id, _report=True)
        outputs = list(stream)
        return outputs[-1], self._served_by.pop(stream.request_id, None)

    # ---- serving one request (a worker thread) ----------------------------------------------------
    def _serve(self, job: _Job) -> None:
        delivered: list[int] = []
        try:
            for attempt in range(self.config.max_attempts):
                if job.cancelled:
                    job.stream.put(StreamEnd())
                    return
                try:
                    target, cost = self._place(job)
                except NoReplicaError as exc:
                    job.stream.put(StreamEnd(ServerOverloadedError(f"no replica can serve now: {exc}", 2.0)))
                    return
                try:
                    if self._stream_from(job, target, delivered):
                        return
                except (RayActorError, _StreamBroken, ReplicaUnhealthyError) as exc:
                    unhealthy = isinstance(exc, ReplicaUnhealthyError)
                    self._forget(target, reason=f"unhealthy ({exc})" if unhealthy else f"died ({type(exc).__name__})",
                                 stop=unhealthy)
                    if delivered and job.msg.temperature > 0 and job.msg.seed is None:
                        job.stream.put(StreamEnd(ReplicaFailedError(
                            f"replica {target} died mid-stream; an unseeded sampled request cannot resume: retry")))
                        return
                    self.counters["retries"] += 1
                    job.forced = None
                    log.warning("request %s: retrying on another replica (attempt %d)", job.msg.request_id,
                                attempt + 2)
                finally:
                    self._release(target, cost)
            job.stream.put(StreamEnd(ReplicaFailedError(f"{self.config.max_attempts} replicas failed: retry")))
        except InvalidRequestError as exc:
            job.stream.put(StreamEnd(exc))
        except Exception as exc:  # noqa: BLE001 - never leave a caller waiting
            log.exception("request %s failed", job.msg.request_id)
            job.stream.put(StreamEnd(exc))
        finally:
            with self._lock:
                self._jobs.pop(job.msg.request_id, None)

    def _stream_from(self, job: _Job, target: str, delivered: list[int]) -> bool:
        """Stream the replica's outputs; True when the request finished."""
        rep = self.replicas.get(target)
        if rep is None:  # found dead (by another request or the index sync) since it was chosen
            raise _StreamBroken(f"replica {target} is gone")
        job.replica_id = target
        for ref in rep.actor.generate_stream.remote(job.msg):
            fields = ray.get(ref)
            out = RequestOutput(**{k: v for k, v in fields.items() if k in _OUTPUT_FIELDS})
            tokens = list(out.token_ids)
            if tokens[: len(delivered)] != delivered[: len(tokens)] and len(tokens) >= 1:
                raise RuntimeError(f"replica {target} produced a different output after a retry")
            if len(tokens) <= len(delivered) and not out.finished:
                continue  # a prefill chunk, or tokens the caller already has
            out = dataclasses.replace(out, new_token_ids=tuple(tokens[len(delivered):]))
            delivered[:] = tokens
            if out.finished:
                self._remember(job.msg)
                if job.report_replica:
                    self._served_by[job.msg.request_id] = target
            job.stream.put(out)
            if out.finished:
                return True
        if job.cancelled:  # aborted (client gone): the replica ended the stream on purpose
            job.stream.put(StreamEnd())
            return True
        raise _StreamBroken(f"replica {target} ended the stream early")

    def _release(self, replica_id: str, cost: int) -> None:
        with self._lock:
            rep = self.replicas.get(replica_id)
            if rep is not None:
                rep.queued_tokens -= cost
                rep.num_inflight -= 1

    # ---- routing --------------------------------------------------------------------------------
    def _place(self, job: _Job) -> tuple[str, int]:
        """Pick (and reserve load on) the replica for this attempt, moving pages there if planned."""
        msg = job.msg
        with self._route_lock:
            decision, active = self._decide(msg)
            if job.forced in active:
                target = job.forced
            elif decision is not None:
                target = decision.replica_id
            else:
                target = min(active, key=lambda r: (active[r], r))  # load only
            hit = 0
            if decision is not None:
                hit = next((e.hit_tokens for e in decision.estimates if e.replica_id == target),
                           decision.expected_hit_tokens)
            cost = len(msg.prompt_token_ids) - hit + msg.max_tokens
            with self._lock:
                rep = self.replicas.get(target)
                if rep is not None:  # else gone meanwhile: the attempt fails over (see `_stream_from`)
                    rep.queued_tokens += cost
                    rep.num_inflight += 1
        if self.metrics is not None and hasattr(self.metrics, "record_route"):
            self.metrics.record_route(self.config.policy if decision else "load_only", target)
        if self.on_routed is not None:
            self.on_routed(msg, decision, target)
        if decision is not None:
            self._maybe_transfer(msg, decision, target)
        return target, cost

    def _decide(self, msg: GenerateMsg, idle: bool = False) -> tuple[RouteDecision | None, dict[str, int]]:
        """Sync, then ask the service. Returns (decision or None for load-only, the routable
        replicas with their queued tokens). Raises `NoReplicaError` when no replica is alive."""
        try:
            self._sync()
            service_up = True
        except (RayActorError, GetTimeoutError) as exc:
            self._service_down(exc)
            service_up = False
        with self._lock:
            active = {r: 0 if idle else rep.queued_tokens for r, rep in self.replicas.items() if not rep.draining}
        if not active:
            raise NoReplicaError("no live replica")
        if not service_up:
            return None, active
        try:
            decision = ray.get(self.service.route.remote(msg.prompt_token_ids, msg.cache_salt, active),
                               timeout=SERVICE_TIMEOUT_S)
        except NoReplicaError:
            return None, active  # the (restarted) index knows no replica yet: load only this time
        except (RayActorError, GetTimeoutError) as exc:
            self._service_down(exc)
            return None, active
        self.counters["routed"] += 1
        return decision, active

    def _service_down(self, exc: BaseException) -> None:
        self.counters["load_only"] += 1
        log.warning("cache service unavailable (%s): routing by load", type(exc).__name__)

    def _sync(self) -> None:
        """Pull events from every replica into the service; resync replicas it cannot follow."""
        with self._lock:
            reps = list(self.replicas.values())
        refs = {rep.replica_id: rep.actor.drain_events.remote() for rep in reps}
        for rid, ref in refs.items():
            try:
                _, events, emitted_below = ray.get(ref, timeout=SERVICE_TIMEOUT_S)
            except ReplicaUnhealthyError as exc:
                self._forget(rid, reason=f"unhealthy ({exc})", stop=True)
                continue
            except (RayActorError, GetTimeoutError):
                self._forget(rid, reason="unreachable")
                continue
            rep = self.replicas.get(rid)
            if rep is None:
                continue
            events = [e for e in events if e.seq >= rep.next_seq]  # older ones are in the last snapshot
            ok = ray.get(self.service.ingest.remote(rid, events), timeout=SERVICE_TIMEOUT_S)
            if ok and self._follow(rep, events) < emitted_below:
                ok = False  # events the replica emitted never arrived (a lost last batch): resync
                log.warning("%s: cache events below seq %d were lost", rid, emitted_below)
            if not ok:
                try:
                    contents, next_seq = ray.get(rep.actor.snapshot.remote(), timeout=SERVICE_TIMEOUT_S)
                except (ReplicaUnhealthyError, RayActorError, GetTimeoutError) as exc:
                    self._forget(rid, reason=f"unreachable ({type(exc).__name__})",
                                 stop=isinstance(exc, ReplicaUnhealthyError))
                    continue
                ray.get(self.service.resync.remote(rid, contents, next_seq), timeout=SERVICE_TIMEOUT_S)
                rep.next_seq = next_seq
                self.counters["service_resyncs"] += 1
                log.info("resynced %s into the cache service (%d entries)", rid, sum(map(len, contents)))

    @staticmethod
    def _follow(rep: _Replica, events: list) -> int:
        """Advance past a batch the service accepted; returns the seq now expected next."""
        if events:
            rep.next_seq = events[-1].seq + 1
        return rep.next_seq

    # ---- transfers ------------------------------------------------------------------------------
    @staticmethod
    def _better_holder(decision: RouteDecision, target: str):
        """The replica that would hit more of the prompt than `target` does, or None."""
        here = next((e.hit_tokens for e in decision.estimates if e.replica_id == target), 0)
        holder = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
        if holder is not None and holder.replica_id != target and holder.hit_tokens > here:
            return holder
        return None

    def _maybe_transfer(self, msg: GenerateMsg, decision: RouteDecision, target: str) -> None:
        if decision.transfer is not None and decision.transfer.dst_replica == target:
            self.transfer(msg.prompt_token_ids, msg.cache_salt, decision.transfer.src_replica, target,
                          decision.transfer.num_tokens)
            return
        holder = self._better_holder(decision, target)
        if holder is not None:
            self.transfer(msg.prompt_token_ids, msg.cache_salt, holder.replica_id, target, holder.hit_tokens)

    def transfer(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
                 num_tokens: int) -> bool:
        """Move the pages serving a `num_tokens` hit src -> dst; on any failure log why and return
        False (the request then recomputes)."""
        t0 = time.perf_counter()
        with self._lock:  # one transfer at a time per (src, dst): they share one ordered channel
            pair_lock = self._pair_locks.setdefault((src, dst), threading.Lock())
        try:
            with pair_lock:
                s, d = self.replicas[src], self.replicas[dst]
                endpoint = ray.get(s.actor.channel_endpoint.remote(), timeout=SERVICE_TIMEOUT_S)
                gen = self._channel_gen.get((src, dst), 0)  # a fresh pair after a failure
                sent = s.actor.send_prefix.remote(prompt_token_ids, cache_salt, num_tokens, dst, gen)
                received = d.actor.recv_prefix.remote(src, endpoint, gen)
                nbytes, _ = ray.get([sent, received], timeout=self.config.transfer_timeout_s)
            self.counters["transfers"] += 1
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failure falls back to recompute
            log.warning("transfer %s -> %s of %d tokens failed (%s): recomputing", src, dst, num_tokens, exc)
            self.counters["transfer_failures"] += 1
            self._channel_gen[(src, dst)] = self._channel_gen.get((src, dst), 0) + 1
            for a, b in ((src, dst), (dst, src)):
                rep = self.replicas.get(a)
                if rep is not None:
                    rep.actor.drop_channel.remote(b)
            nbytes, ok = 0, False
        if self.metrics is not None and hasattr(self.metrics, "record_transfer"):
            self.metrics.record_transfer(ok, time.perf_counter() - t0, nbytes)
        return ok

    def _remember(self, msg: GenerateMsg) -> None:
        """Keep the most recently served prompts (by use count), to warm new replicas with."""
        align = self.limits["alignment"]
        length = (len(msg.prompt_token_ids) - 1) // align * align
        if length <= 0:
            return
        key = (tuple(msg.prompt_token_ids[: length + 1]), msg.cache_salt)
        with self._lock:
            self._hot[key] = self._hot.pop(key, 0) + 1
            while len(self._hot) > self.config.hot_prefixes:
                self._hot.popitem(last=False)

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        """Copy the hottest known prefixes onto `replica_id` from their holders. Returns transfers done."""
        with self._lock:
            hot = sorted(self._hot.items(), key=lambda kv: -kv[1])[: limit or len(self._hot)]
        done = 0
        for (prompt, salt), _ in hot:
            with self._route_lock:
                decision, _ = self._decide(GenerateMsg(list(prompt), cache_salt=salt), idle=True)
            if decision is None:
                break
            holder = self._better_holder(decision, replica_id)
            if holder is not None:
                done += self.transfer(list(prompt), salt, holder.replica_id, replica_id, holder.hit_tokens)
        return done

    # ---- status ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            reps = {r: {"queued_tokens": rep.queued_tokens, "inflight": rep.num_inflight, "draining": rep.draining,
                        "node_id": rep.info["node_id"]} for r, rep in self.replicas.items()}
        return {"replicas": reps, "inflight": len(self._jobs), **self.counters}

    def service_stats(self) -> dict:
        return ray.get(self.service.stats.remote(), timeout=SERVICE_TIMEOUT_S)

    def index_problems(self) -> list[str]:
        """Where the cache service's index differs from the live replicas' caches (empty: consistent).

        Each replica's pending events and a snapshot are taken at one instant and the events fed to
        the service, which must then hold exactly the snapshot: no stale or dead replica, the same
        next seq and entry counts. Takes the routing lock; repairs nothing (routing does)."""
        problems = []
        with self._route_lock:
            with self._lock:
                reps = list(self.replicas.values())
            taken = {}
            for rep in reps:
                try:
                    events, contents, next_seq = ray.get(rep.actor.drain_and_snapshot.remote(),
                                                         timeout=SERVICE_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - dead, unhealthy, or slow: not consistent
                    problems.append(f"{rep.replica_id}: unreachable ({type(exc).__name__})")
                    continue
                taken[rep.replica_id] = ([len(set(c)) for c in contents], next_seq)
                events = [e for e in events if e.seq >= rep.next_seq]
                try:
                    if ray.get(self.service.ingest.remote(rep.replica_id, events), timeout=SERVICE_TIMEOUT_S):
                        self._follow(rep, events)
                except (RayActorError, GetTimeoutError):
                    return problems + ["cache service unreachable"]
            try:
                stats = self.service_stats()["replicas"]
            except (RayActorError, GetTimeoutError):
                return problems + ["cache service unreachable"]
        problems += [f"{r}: indexed but not a live replica" for r in stats if r not in self.replicas]
        for rid, (entries, next_seq) in taken.items():
            s = stats.get(rid)
            if s is None:
                problems.append(f"{rid}: not in the index")
            elif s["stale"]:
                problems.append(f"{rid}: stale (waiting for a resync)")
            elif s["next_seq"] != next_seq or s["entries"] != entries:
                problems.append(f"{rid}: index has seq {s['next_seq']} entries {s['entries']}, "
                                f"replica seq {next_seq} entries {entries}")
        return problems

    def shutdown(self) -> None:
        self._stop.set()
        for job in list(self._jobs.values()):
            self.abort(job.msg.request_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
        reps = list(self.replicas.values())
        try:  # stop engines (and TP workers) cleanly, then make sure
            ray.wait([rep.actor.shutdown.remote() for rep in reps], num_returns=len(reps), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        for rep in reps:
            try:
                ray.kill(rep.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.replicas.clear()
        try:
            ray.kill(self.service, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
