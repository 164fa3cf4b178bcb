"""`python -m bench.control_plane`: the control plane at R = 8, 64, 256 replicas, as JSON and a table.

Simulated replicas (`bench.sim_replicas`: real Ray actors answering from synthetic caches, each
with the production event publisher) resync into a real cache-service actor and push churn
while a front door routes prompts (asyncio, `concurrency` decisions in flight, each hashing its
prompt), two ways:
    read replica   the default: the front door's copy of the index, kept in step with the
                   service's op log by a follower thread (`cluster.frontdoor.index_follower`)
    service        `cluster.read_replica: false`: one `route_many` call per batch of decisions
Beside them, the same decisions in process (hash + `CacheService.route` on an index with the
same content, no Ray, no churn). Each Ray measurement runs `--repeats` times on the same
cluster; the table gives the median and the 1-minute load average after the last one.

    decisions/s, p50/p99 ms     per R and way; at a paced `paced_rate`/s (open loop) and closed loop
    growth                      per-decision cost at the largest R over the smallest
    index bytes per 1M entries  tracemalloc around 1M resynced entries
    resync s for 1M entries     in process, and through Ray (a simulated replica's chunked resync)
    kill during resync          the service is killed during a 1M-entry resync: decisions keep
                                coming (by load), and the replica's index is back afterwards
    tiny requests               16 prompt tokens, 1 output token, concurrency 32: the Ray backend's
                                requests/s over the in-process backend's (`--tiny`, needs the model)

Targets (issue 33): R = 64: p99 <= 10 ms at 1,000 decisions/s and >= 2,000 decisions/s; R = 256:
p99 <= 25 ms at 1,000/s; cost growth 8 -> 256 <= 2x; tiny >= 0.7.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.reports import default_report, write_report
from bench.sim_replicas import GROUPS, HASH_BLOCK, SimReplicaHost, document_hashes, synthetic_cache

TINY_TRAINED = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-trained")


@dataclass(frozen=True)
class PlaneConfig:
    replicas: tuple[int, ...] = (8, 64, 256)
    num_prefixes: int = 128
    prompt_len: int = 2048
    docs_per_replica: int = 8
    entries_per_replica: int = 4000
    decisions: int = 3000
    concurrency: int = 32  # closed loop: the most decisions/s
    paced_rate: float = 1000.0  # open loop: latency at this many decisions/s
    num_hosts: int = 4  # actors hosting the simulated replicas
    churn_blocks_per_s: int = 2000  # cluster-wide stored blocks per second during the measurement
    resync_entries: int = 1_000_000
    repeats: int = 3  # Ray measurements per R and way (the table: their median)
    shards: tuple[int, ...] = (1, 2)  # index shards measured (1: also the route through the service)
    seed: int = 0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _summary(latencies: list[float], wall_s: float) -> dict:
    return {"decisions_per_s": round(len(latencies) / wall_s, 1),
            "p50_ms": round(1e3 * statistics.median(latencies), 3), "p99_ms": round(1e3 * _pct(latencies, 0.99), 3)}


def _prompts(config: PlaneConfig, docs_tokens: list[list[int]], rng: random.Random) -> list[tuple[list[int], None]]:
    """Prompts sharing a document prefix (and a fresh tail)."""
    out = []
    for _ in range(config.decisions):
        doc = docs_tokens[rng.randrange(len(docs_tokens))]
        cut = rng.randrange(256, len(doc) + 1)
        out.append((doc[:cut] + [rng.randrange(128_000) for _ in range(rng.randrange(1, 200))], None))
    return out


# ---- in process ------------------------------------------------------------------------------------
def in_process(config: PlaneConfig, num_replicas: int, docs, prompts) -> dict:
    from cache_service.block_hash import RequestBlockHashes
    from cache_service.messages import LoadReportMsg, RouteRequestMsg
    from cache_service.service import CacheService

    service = CacheService(list(GROUPS), "lossless", "", seed=config.seed)
    rng = random.Random(config.seed)
    for r in range(num_replicas):
        rid = f"sim-{r}"
        service.resync(rid, synthetic_cache(rng, docs, config.docs_per_replica, config.entries_per_replica), 0)
        service.loads.report(rid, LoadReportMsg(rng.randrange(0, 4096)))
    latencies = []
    t_all = time.perf_counter()
    for tokens, salt in prompts:
        t0 = time.perf_counter()
        hashes = RequestBlockHashes(HASH_BLOCK, tokens, cache_salt=salt).hashes
        service.route(RouteRequestMsg(tuple(hashes), len(tokens), salt, 16))
        latencies.append(time.perf_counter() - t0)
    return _summary(latencies, time.perf_counter() - t_all) | {"entries": service.index.num_entries}


# ---- through Ray -----------------------------------------------------------------------------------
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


# ---- memory and resync ---------------------------------------------------------------------------------
def index_memory(num_entries: int) -> dict:
    from cache_service.global_index import GlobalIndex

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keys = [os.urandom(16) for _ in range(num_entries)]  # the keys live in the index (they arrive with events)
    index = GlobalIndex(3)
    index.begin_resync("r", "m")
    third = num_entries // 3
    for g, part in enumerate((keys[:third], keys[third: 2 * third], keys[2 * third:])):
        index.resync_chunk("r", "m", g, part)
    del keys  # the list itself is not index memory; the key objects stay referenced by the index
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"bytes_per_entry_incl_keys": round(used / num_entries, 1),
            "mib_per_1m_entries": round(used / num_entries * 1e6 / 2**20, 1)}


def resync_in_process(num_entries: int) -> float:
    from cache_service.global_index import GlobalIndex

    keys = [os.urandom(16) for _ in range(num_entries)]
    index = GlobalIndex(3)
    t0 = time.perf_counter()
    index.begin_resync("r", "x")
    for i in range(0, num_entries, 65536):
        index.resync_chunk("r", "x", 0, keys[i: i + 65536])
    index.end_resync("r", "x", 0)
    return time.perf_counter() - t0


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


# ---- all of it ----------------------------------------------------------------------------------------------
def run_all(config: PlaneConfig, tiny: bool, model_dir: str) -> dict:
    from cache_service.simulate import make_tokens
    from cluster.control.ray_cluster import start_local_ray

    rng = random.Random(config.seed)
    docs_tokens = [make_tokens(config.prompt_len, config.seed * 100_003 + d, 128_000)
                   for d in range(config.num_prefixes)]
    docs = document_hashes(config.num_prefixes, config.prompt_len, config.seed)
    prompts = _prompts(config, docs_tokens, rng)
    report: dict = {"config": asdict(config), "routing": {}}
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rp", dir="/tmp"))
    start_local_ray(num_cpus=2)
    for r in config.replicas:
        report["routing"][r] = {"in_process": in_process(config, r, docs, prompts),
                                "ray": through_ray(config, r, docs, prompts)}
        for n in (n for n in config.shards if n > 1):
            report["routing"][r][f"ray_{n}_shards"] = through_ray(config, r, docs, prompts, n)
        print(f"R={r}: {report['routing'][r]}", file=sys.stderr)
    lo, hi = min(config.replicas), max(config.replicas)
    for kind, pick in (("in_process", lambda v: v["in_process"]), ("read_replica", lambda v: v["ray"]["read_replica"]),
                       ("service", lambda v: v["ray"]["service"])):
        a, b = pick(report["routing"][lo]), pick(report["routing"][hi])
        report.setdefault("growth", {})[kind] = round(a["decisions_per_s"] / b["decisions_per_s"], 2)
    report["growth_equal_hits"] = growth_equal_hits(config, lo, hi)
    report["index_memory"] = index_memory(config.resync_entries)
    report["resync_1m"] = {"in_process_s": round(resync_in_process(config.resync_entries), 2),
                           **resync_through_ray(config, docs, prompts, kill_midway=False)}
    report["kill_during_resync"] = resync_through_ray(config, docs, prompts, kill_midway=True)
    if max(config.shards) > 1:
        report["kill_during_resync_sharded"] = resync_through_ray(config, docs, prompts, kill_midway=True,
                                                                  num_shards=max(config.shards))
    if tiny:
        from bench.tiny_requests import tiny_requests

        report["tiny_requests"] = tiny_requests(model_dir, 400, 32)
    return report


def format_table(report: dict) -> str:
    rate = report["config"]["paced_rate"]
    rows = [f"median of {report['config']['repeats']} runs per row; load: 1-minute load average after them",
            f"{'R':>5}  {'way':<13}{'max dec/s':>10}{f'at {rate:.0f}/s p50 ms':>18}{'p99 ms':>8}{'load':>6}",
            "-" * 60]
    for r, v in report["routing"].items():
        ways = [("read replica", v["ray"]["read_replica"], v["ray"]),
                ("service", v["ray"]["service"], v["ray"])]
        ways += [(f"{k.split('_')[1]} shards", v[k]["read_replica"], v[k]) for k in v if k.endswith("_shards")]
        for way, a, run in ways:
            paced = a[f"at_{rate:.0f}_per_s"]
            rows.append(f"{r:>5}  {way:<13}{a['decisions_per_s']:>10.0f}{paced['p50_ms']:>18.2f}"
                        f"{paced['p99_ms']:>8.2f}{run['load_avg_1m']:>6.2f}")
        b = v["in_process"]
        rows.append(f"{r:>5}  {'in process':<13}{b['decisions_per_s']:>10.0f}{'':>18}{b['p99_ms']:>8.2f}"
                    "  (closed loop p99)")
    rows.append(f"cost growth (R min -> max): {report['growth']}")
    eq = report["growth_equal_hits"]
    rows.append(f"cost growth at equal hits (documents x R): {eq['growth']} "
                f"({', '.join(f'R={r}: {v}' for r, v in eq.items() if r != 'growth')})")
    rows.append(f"index memory: {report['index_memory']}")
    rows.append(f"resync of 1M entries: {report['resync_1m']}")
    rows.append(f"service killed during a 1M-entry resync: {report['kill_during_resync']}")
    if "kill_during_resync_sharded" in report:
        rows.append(f"  the same, sharded (the replica's shard killed): {report['kill_during_resync_sharded']}")
    if "tiny_requests" in report:
        rows.append(f"tiny requests (16 in, 1 out, concurrency 32): {report['tiny_requests']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="8,64,256", help="comma-separated R values")
    p.add_argument("--decisions", type=int, default=PlaneConfig.decisions)
    p.add_argument("--repeats", type=int, default=PlaneConfig.repeats, help="Ray measurements per R and way")
    p.add_argument("--shards", default="1,2", help="comma-separated index shard counts measured (1 is always run)")
    p.add_argument("--resync-entries", type=int, default=PlaneConfig.resync_entries)
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-request comparison (needs the model)")
    p.add_argument("--model", default=TINY_TRAINED)
    p.add_argument("--out", default=default_report("control-plane"), help="JSON report path (default: under out/)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    config = PlaneConfig(replicas=tuple(int(x) for x in args.replicas.split(",")), decisions=args.decisions,
                         resync_entries=args.resync_entries, repeats=args.repeats,
                         shards=tuple(sorted({1, *(int(x) for x in args.shards.split(","))})))
    report = run_all(config, not args.no_tiny, args.model)
    print(format_table(report))
    write_report(args.out, report)
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
