"""A front door's link to the cache service: hash the prompt, get (replica, expected hit, optional
transfer plan).

Where the decision is made:
    read replica (default)   the front door's own copy of the service's routing state
                             (`index_follower.IndexFollower` keeps it in step with the service's
                             op log): decided in process, no Ray call per decision
    the service              (`read_replica=False`, or while the copy is not ready) one call per
                             batch of decisions (`RouteBatcher`, `CacheService.route_many`)
Either way the same `CacheService.route`, on the same index. No lock is held across a Ray call,
so decisions from many threads and many front doors proceed at once. When the service is down
(Ray restarts it) or knows no replica yet, the front door routes by its own view of load (its
requests in flight per replica; ties at random) until the service answers again.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections import deque
from concurrent.futures import Future

import ray

from cache_service.block_hash import RequestBlockHashes
from cache_service.index_mirror import ShardedMirror
from cache_service.messages import RouteDecision, RouteRequestMsg
from cache_service.router import NoReplicaError
from cache_service.shards import shard_service_name
from cluster.frontdoor.index_follower import IndexFollower
from workers.replica_messages import GenerateMsg

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 10.0


class RouteBatcher:
    """At most `max_in_flight` route calls in flight; requests that arrive meanwhile ride the next
    call together (`CacheService.route_many`). At a low rate every request is its own call; under
    load the per-call overhead of Ray is shared, so throughput grows instead of latency."""

    def __init__(self, get_service, max_in_flight: int = 2, max_batch: int = 128,
                 timeout_s: float = ROUTE_TIMEOUT_S) -> None:
        self.get_service = get_service
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.num_calls = 0
        self._pending: deque = deque()
        self._cv = threading.Condition()
        for i in range(max_in_flight):
            threading.Thread(target=self._run, name=f"route-batcher-{i}", daemon=True).start()

    def submit(self, msg: RouteRequestMsg) -> Future:
        """A future of the decision (None: the service knows no replica)."""
        future: Future = Future()
        with self._cv:
            self._pending.append((msg, future))
            self._cv.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), self.max_batch))]
            try:
                ref = self.get_service().route_many.remote([msg for msg, _ in batch])
                self.num_calls += 1
                results = ray.get(ref, timeout=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - every waiter learns why
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), decision in zip(batch, results):
                future.set_result(decision)


class RoutingClient:
    def __init__(self, service_name: str, namespace: str | None, hash_block_size: int, fingerprint: str,
                 timeout_s: float = ROUTE_TIMEOUT_S, seed: int | None = None, read_replica: bool = True,
                 client_id: str = "", num_shards: int = 1) -> None:
        """`read_replica`: decide on a copy of the index held here (see the module doc); `client_id`
        names this front door's bookings in the service's log; `num_shards`: the index's shards
        (`cache_service.shards`; more than one needs the read replica: until every shard's copy
        is ready, decisions go by load)."""
        if num_shards > 1 and not read_replica:
            raise ValueError("a sharded index is routed on the front door's read replica (read_replica=True)")
        self.service_name = service_name
        self.num_shards = num_shards
        self.namespace = namespace
        self.hash_block_size = hash_block_size
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.counters = {"routed": 0, "load_only": 0, "decided_here": 0}
        self._rng = random.Random(seed)
        self._services: list = [None] * num_shards
        self.batcher = RouteBatcher(lambda: self.service, timeout_s=timeout_s)
        self.mirror = ShardedMirror(client_id or f"door-{id(self):x}", num_shards) if read_replica else None
        self.followers = [IndexFollower(functools.partial(self.shard, k), m,
                                        on_failure=functools.partial(self._forget, k))
                          for k, m in enumerate(self.mirror.shards)] if read_replica else []

    def _forget(self, k: int) -> None:
        self._services[k] = None

    def close(self) -> None:
        for follower in self.followers:
            follower.stop()

    def shard(self, k: int):
        """Shard k's actor handle (looked up again after a failure: Ray may have restarted it)."""
        if self._services[k] is None:
            self._services[k] = ray.get_actor(shard_service_name(self.service_name, k), namespace=self.namespace)
        return self._services[k]

    @property
    def service(self):
        return self.shard(0)

    def hashes(self, prompt: list[int] | tuple[int, ...], salt: str | None) -> tuple:
        return tuple(RequestBlockHashes(self.hash_block_size, prompt, model_fingerprint=self.fingerprint,
                                        cache_salt=salt).hashes)

    def route(self, msg: GenerateMsg, inflight: dict[str, int], forced: str | None = None,
              exclude: tuple[str, ...] = (), dry_run: bool = False,
              role: str = "mixed") -> tuple[str, RouteDecision | None]:
        """(target, decision or None when routed by load). `inflight`: the routable replicas here
        and this front door's requests on each. `role`: "mixed" (the whole request), "prefill"
        (up to its first token: that much output booked) or "decode" (the decoder of a prefilled
        request: `cache_service.decode_placement`). Raises `NoReplicaError` if there is none."""
        candidates = {r: n for r, n in inflight.items() if r not in exclude}
        if not candidates:
            raise NoReplicaError("no live replica")
        hashes = msg.block_hashes if msg.block_hashes is not None else self.hashes(msg.prompt_token_ids, msg.cache_salt)
        outputs = 1 if role == "prefill" else msg.params.max_tokens
        request = RouteRequestMsg(hashes, len(msg.prompt_token_ids),
                                  msg.cache_salt, outputs, forced if forced in candidates else None,
                                  tuple(exclude), dry_run, decode_handoff=role == "decode")
        decision = self._decide(request)
        if forced in candidates:
            return forced, decision
        if decision is not None and decision.replica_id in candidates:
            self.counters["routed"] += 1
            return decision.replica_id, decision
        self.counters["load_only"] += 1
        least = min(candidates.values())
        return self._rng.choice(sorted(r for r, n in candidates.items() if n == least)), None

    def _send_booked(self) -> None:
        """The load just booked on the copy, to its shard now (one call, no reply awaited): it must
        reach the service before the replica's report of the request does, or that report cannot
        retire it and it counts until it expires (the autoscaler would see phantom requests)."""
        for k, mirror in enumerate(self.mirror.shards):
            booked = mirror.take_booked()
            if booked:
                try:
                    self.shard(k).note_routed.remote(booked)
                except Exception:  # noqa: BLE001 - the service is down: a restarted one has no loads to fix
                    self._forget(k)

    def _decide(self, request: RouteRequestMsg) -> RouteDecision | None:
        """The service's decision (here on the read replica when it is ready); None: no replica
        known, or the service is unreachable."""
        if self.mirror is not None and self.mirror.ready:
            try:
                decision = self.mirror.route(request)
                self.counters["decided_here"] += 1
                self._send_booked()
                return decision
            except NoReplicaError:
                if self.mirror.ready:
                    return None  # the service knows no replica either
        if self.num_shards > 1:
            return None  # a shard's copy is not ready: by load
        try:
            return self.batcher.submit(request).result()  # None: a restarted service that knows no replica
        except Exception as exc:  # noqa: BLE001 - dead, restarting, not created yet: route by load
            log.warning("cache service unavailable (%s): routing by load", type(exc).__name__)
            self._service = None
            return None
