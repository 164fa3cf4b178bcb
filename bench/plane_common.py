"""What `bench.control_plane`'s measurements share: the configuration, the prompts, the summary of
latencies, and the decisions in process (hash + `CacheService.route`, no Ray)."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from bench.sim_replicas import GROUPS, HASH_BLOCK, synthetic_cache


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
