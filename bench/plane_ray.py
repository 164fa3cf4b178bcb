"""`bench.control_plane` through Ray: simulated replicas (`bench.sim_replicas`) push to real
cache-service actors (one per shard) while a front door decides on its read replica of the
index or through the service; the service killed during a resync; cost growth at equal hits."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import asdict

from bench.plane_common import PlaneConfig, _prompts, _summary, in_process
from bench.sim_replicas import GROUPS, HASH_BLOCK, SimReplicaHost, document_hashes


def _start(config: PlaneConfig, num_replicas: int, docs, name: str, num_shards: int = 1):
    """The service (shard 0) and the simulated replicas' hosts, every replica resynced; with
    `num_shards` > 1 the other shards are started too (`shards` holds every handle)."""
    import ray

    from cache_service.shards import shard_service_name
    from cluster.control.service_actor import start_cache_service

    ns = ray.get_runtime_context().namespace
    shards = [start_cache_service(shard_service_name(name, k), ns, list(GROUPS), "lossless", "", "hybrid", None,
                                  config.seed) for k in range(num_shards)]
    service = shards[0]
    ids = [f"sim-{r}" for r in range(num_replicas)]
    host_cls = ray.remote(num_cpus=0)(SimReplicaHost)
    hosts = [host_cls.remote(ids[h::config.num_hosts], docs, config.docs_per_replica, config.entries_per_replica,
                             name, ns, config.seed + h, 1.0, num_shards) for h in range(config.num_hosts)]
    ray.get([h.start.remote() for h in hosts])
    deadline = time.monotonic() + 300
    while sum(ray.get([h.num_resynced.remote() for h in hosts])) < num_replicas:
        if time.monotonic() > deadline:
            raise RuntimeError("simulated replicas did not resync within 300 s")
        time.sleep(0.2)
    return (service, hosts) if num_shards == 1 else (shards, hosts)


def _decide(batcher):
    """One front-door decision through the service: hash the prompt, submit it to the route
    batcher, await the answer."""
    from cache_service.block_hash import RequestBlockHashes
    from cache_service.messages import RouteRequestMsg

    async def decide(tokens, salt):
        hashes = RequestBlockHashes(HASH_BLOCK, tokens, cache_salt=salt).hashes
        return await asyncio.wrap_future(batcher.submit(RouteRequestMsg(tuple(hashes), len(tokens), salt, 16)))

    return decide


def _decide_here(mirror):
    """One front-door decision on its read replica: hash the prompt, route in process."""
    from cache_service.block_hash import RequestBlockHashes
    from cache_service.messages import RouteRequestMsg

    async def decide(tokens, salt):
        hashes = RequestBlockHashes(HASH_BLOCK, tokens, cache_salt=salt).hashes
        return mirror.route(RouteRequestMsg(tuple(hashes), len(tokens), salt, 16))

    return decide


async def _route_all(decide, prompts, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    queue = list(prompts)

    async def worker():
        while queue:
            tokens, salt = queue.pop()
            t0 = time.perf_counter()
            await decide(tokens, salt)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def _route_paced(decide, prompts, rate: float) -> tuple[list[float], float]:
    """Open loop: decision i is due at i / rate; its latency counts from then (no coordinated omission)."""
    latencies: list[float] = []

    async def one(tokens, salt, due):
        await decide(tokens, salt)
        latencies.append(time.perf_counter() - due)

    tasks = []
    t0 = time.perf_counter()
    for i, (tokens, salt) in enumerate(prompts):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(tokens, salt, due)))
    await asyncio.gather(*tasks)
    return latencies, time.perf_counter() - t0


def _measure(config: PlaneConfig, decide, prompts) -> dict:
    latencies, wall = asyncio.run(_route_all(decide, prompts, config.concurrency))
    paced, paced_wall = asyncio.run(_route_paced(decide, prompts, config.paced_rate))
    at_rate = _summary(paced, paced_wall)
    return _summary(latencies, wall) | {
        f"at_{config.paced_rate:.0f}_per_s": {"achieved_per_s": at_rate["decisions_per_s"],
                                              "p50_ms": at_rate["p50_ms"], "p99_ms": at_rate["p99_ms"]}}


def _median_run(runs: list[dict], rate_key: str) -> dict:
    """The median of each figure over the runs (each run's figures kept under `runs`)."""
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    return {"decisions_per_s": med([r["decisions_per_s"] for r in runs]),
            "p50_ms": med([r["p50_ms"] for r in runs]), "p99_ms": med([r["p99_ms"] for r in runs]),
            rate_key: {k: med([r[rate_key][k] for r in runs]) for k in ("achieved_per_s", "p50_ms", "p99_ms")},
            "runs": runs}


def through_ray(config: PlaneConfig, num_replicas: int, docs, prompts, num_shards: int = 1,
                measure: tuple[str, ...] = ("read_replica", "service")) -> dict:
    """The ways in `measure` (read replica, service) on one simulated cluster, `repeats` times
    each, churn on; with `num_shards` > 1 the index is sharded and only the read replica runs."""
    import ray

    from cache_service.index_mirror import ShardedMirror
    from cluster.frontdoor.index_follower import IndexFollower
    from cluster.frontdoor.routing_client import RouteBatcher

    started, hosts = _start(config, num_replicas, docs, f"plane-{num_replicas}-{num_shards}-{os.getpid()}", num_shards)
    shards = started if num_shards > 1 else [started]
    service = shards[0]
    batcher = RouteBatcher(lambda: service)
    mirror = ShardedMirror("bench-door", num_shards)
    followers = [IndexFollower(lambda s=s: s, m) for s, m in zip(shards, mirror.shards)]
    rate_key = f"at_{config.paced_rate:.0f}_per_s"
    try:
        deadline = time.monotonic() + 60
        ends = [ray.get(s.stats.remote())["log_end_seq"] for s in shards]
        while not mirror.ready or any(m.cursor < e for m, e in zip(mirror.shards, ends)):
            if time.monotonic() > deadline:
                raise RuntimeError("the front door's read replica did not catch up within 60 s")
            time.sleep(0.05)
        ways = {"read_replica": _decide_here(mirror)}
        if num_shards == 1 and "service" in measure:
            ways["service"] = _decide(batcher)
        for decide in ways.values():
            asyncio.run(_route_all(decide, prompts[:200], config.concurrency))  # warm-up
        step_s = 0.02
        blocks = max(1, int(config.churn_blocks_per_s * step_s / config.num_hosts))
        churn = [h.churn.remote(blocks, step_s, 3600) for h in hosts]
        out: dict = {}
        calls = batcher.num_calls
        for way, decide in ways.items():
            out[way] = _median_run([_measure(config, decide, prompts) for _ in range(config.repeats)], rate_key)
        calls = batcher.num_calls - calls
        for c in churn:
            ray.cancel(c, force=False)
        stats = [ray.get(s.stats.remote()) for s in shards]
        if calls:
            out["service"]["decisions_per_call"] = round(2 * config.repeats * len(prompts) / calls, 1)
        out["read_replica"]["ops_followed"] = sum(m.num_ops for m in mirror.shards)
        out["read_replica"]["follower_failures"] = sum(f.num_failures for f in followers)
        out["load_avg_1m"] = round(os.getloadavg()[0], 2)
        return out | {"entries": sum(st["num_entries"] for st in stats),
                      "batches_pushed": sum(st["batches"] for st in stats)}
    finally:
        for f in followers:
            f.stop()
        for h in hosts:
            ray.kill(h)
        for s in shards:
            ray.kill(s)


def growth_equal_hits(config: PlaneConfig, lo: int, hi: int) -> dict:
    """Per-decision cost growth from `lo` to `hi` replicas at the same hit structure: the documents
    grow with the replicas (`num_prefixes` * R / lo), so a prompt has as many holders and as long a
    hit at both sizes. With a fixed document set, a prompt at 256 replicas has 28x the holders and
    5x the hit of one at 8, and a decision's work follows its hit (the walk of the matched chain),
    not the replica count. Read replica through Ray (closed loop) and in process."""
    from cache_service.simulate import make_tokens

    out: dict = {}
    for r in (lo, hi):
        scaled = PlaneConfig(**{**asdict(config), "num_prefixes": config.num_prefixes * r // lo, "repeats": 1})
        rng = random.Random(config.seed)
        docs_tokens = [make_tokens(scaled.prompt_len, config.seed * 100_003 + d, 128_000)
                       for d in range(scaled.num_prefixes)]
        docs = document_hashes(scaled.num_prefixes, scaled.prompt_len, config.seed)
        prompts = _prompts(scaled, docs_tokens, rng)
        out[r] = {"in_process": in_process(scaled, r, docs, prompts)["decisions_per_s"],
                  "read_replica": through_ray(scaled, r, docs, prompts, measure=("read_replica",))
                  ["read_replica"]["decisions_per_s"], "num_prefixes": scaled.num_prefixes}
    return out | {"growth": {k: round(out[lo][k] / out[hi][k], 2) for k in ("in_process", "read_replica")}}


def resync_through_ray(config: PlaneConfig, docs, prompts, kill_midway: bool, num_shards: int = 1) -> dict:
    """One simulated replica with `resync_entries` entries resyncs through Ray; with `kill_midway`
    the service (sharded: the replica's shard) is killed during it while a front door keeps
    routing (by load when it must)."""
    import ray

    from cache_service.ids import new_request_id
    from cache_service.shards import shard_of
    from cluster.frontdoor.routing_client import RoutingClient
    from workers.engine.sampling_params import SamplingParams
    from workers.replica_messages import GenerateMsg

    name = f"plane-resync-{kill_midway}-{num_shards}-{os.getpid()}"
    one = PlaneConfig(**{**asdict(config), "num_hosts": 1, "entries_per_replica": config.resync_entries})
    started, (host,) = _start(one, 1, docs, name, num_shards)
    shards = started if num_shards > 1 else [started]
    service = shards[shard_of("sim-0", num_shards)]
    try:
        out: dict = {}
        if not kill_midway:
            out["resync_s"] = round(ray.get(host.resync_one.remote("sim-0")), 2)
            return out
        client = RoutingClient(name, ray.get_runtime_context().namespace, HASH_BLOCK, "", timeout_s=2.0,
                               num_shards=num_shards)
        ray.get(host.stop.remote())  # this run drives the resync itself
        resync = host.resync_one.remote("sim-0")
        time.sleep(0.05)
        ray.kill(service, no_restart=False)
        t_kill = time.perf_counter()
        try:
            ray.get(resync)
        except Exception as exc:  # noqa: BLE001 - the killed service refuses or drops the rest
            out["first_resync"] = f"failed as expected ({type(exc).__name__})"
        decided = 0
        for tokens, salt in prompts[:50]:
            msg = GenerateMsg(new_request_id(), tuple(tokens), SamplingParams(temperature=0.0), salt,
                              client.hashes(tokens, salt))
            target, _ = client.route(msg, {"sim-0": 0})
            decided += target == "sim-0"
        out["decisions_while_down"] = decided
        deadline = time.monotonic() + 60
        while True:  # the replica retries until the restarted service answers
            try:
                out["recovered_resync_s"] = round(ray.get(host.resync_one.remote("sim-0")), 2)
                break
            except Exception:  # noqa: BLE001 - still restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        stats = ray.get(service.stats.remote())
        out["entries_after"] = stats["replicas"]["sim-0"]["entries"]
        out["stale_after"] = stats["replicas"]["sim-0"]["stale"]
        out["recovery_s"] = round(time.perf_counter() - t_kill, 2)
        out["router_counters"] = client.counters
        copy = client.mirror.shards[shard_of("sim-0", num_shards)]
        deadline = time.monotonic() + 30  # the front door's copy follows the restarted instance
        while copy.epoch != stats["epoch"] and time.monotonic() < deadline:
            time.sleep(0.05)
        out["read_replica_follows_restarted"] = copy.epoch == stats["epoch"]
        client.close()
        return out
    finally:
        ray.kill(host)
        for s in shards:
            ray.kill(s)
