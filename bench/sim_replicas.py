"""Simulated replicas for `bench.control_plane`: real Ray actors that answer from synthetic caches.

A `SimReplicaHost` actor hosts several simulated replicas (256 processes would not fit this
machine). Each has its own `EventSink` and the production `EventPublisher`: it resyncs its
synthetic cache into the cache service in chunks, then pushes churn (blocks stored and evicted)
as packed event batches with its load, exactly as a real replica does after each engine step.

The synthetic cache: `num_prefixes` shared documents of `prompt_len` tokens; each replica holds
a few of them up to a random cut (full + draft blocks, and Mamba snapshots at the cut and at
every 1024 tokens below it), plus filler entries up to `entries_per_replica`.
"""

from __future__ import annotations

import os
import random
import threading

from cache_service.block_hash import RequestBlockHashes
from cache_service.events import EventSink
from cache_service.messages import LoadReportMsg
from cache_service.simulate import make_tokens

GROUPS = ("full:16", "mamba:64", "draft:16")
HASH_BLOCK = 16


def document_hashes(num_prefixes: int, prompt_len: int, seed: int = 0) -> list[list[bytes]]:
    return [RequestBlockHashes(HASH_BLOCK, make_tokens(prompt_len, seed * 100_003 + d, 128_000)).hashes
            for d in range(num_prefixes)]


def synthetic_cache(rng: random.Random, docs: list[list[bytes]], docs_per_replica: int,
                    entries_per_replica: int) -> list[list[bytes]]:
    full, mamba = [], []
    for d in rng.sample(range(len(docs)), min(docs_per_replica, len(docs))):
        cut = rng.randrange(1, len(docs[d]) + 1) // 4 * 4 or 4  # in hash blocks (64-token units)
        full += docs[d][:cut]
        mamba += [docs[d][i - 1] for i in range(64, cut + 1, 64)] + [docs[d][cut - 1]]
    filler = max(0, entries_per_replica - 2 * len(full) - len(mamba))
    extra = [os.urandom(16) for _ in range(filler)]
    third = len(extra) // 3
    return [full + extra[:third], mamba + extra[third: 2 * third], full + extra[2 * third:]]


class SimReplicaHost:
    """The actor body: replicas `ids`, each publishing to the named cache service (with
    `num_shards` > 1: to the shard holding it, `cache_service.shards`)."""

    def __init__(self, ids: list[str], docs: list[list[bytes]], docs_per_replica: int, entries_per_replica: int,
                 service_name: str, namespace: str | None, seed: int = 0, heartbeat_s: float = 1.0,
                 num_shards: int = 1) -> None:
        from cache_service.shards import shard_of, shard_service_name
        from workers.event_publisher import EventPublisher

        rng = random.Random(seed)
        self.caches = {r: synthetic_cache(rng, docs, docs_per_replica, entries_per_replica) for r in ids}
        self.sinks = {r: EventSink(r) for r in ids}
        self.publishers = {}
        for r in ids:
            shard = shard_service_name(service_name, shard_of(r, num_shards))
            pub = EventPublisher(r, self.sinks[r], self._snapshot(r), shard, namespace, heartbeat_s=heartbeat_s)
            pub.request_resync()  # start with a chunked resync of the synthetic cache
            pub.on_step(LoadReportMsg(rng.randrange(0, 4096), rng.randrange(0, 8), 1000, 0))
            self.publishers[r] = pub
        self._rng = rng
        self._churn = threading.Event()
        self._lock = threading.Lock()

    def _snapshot(self, rid: str):
        from workers.event_publisher import CacheSnapshot

        def take():
            with self._lock:
                self.sinks[rid].take_batch()
                return CacheSnapshot([list(g) for g in self.caches[rid]], self.sinks[rid].next_seq)
        return take

    def start(self) -> None:
        for pub in self.publishers.values():
            pub.start()

    def num_resynced(self) -> int:
        return sum(p.in_sync for p in self.publishers.values())

    def churn(self, blocks_per_step: int, step_s: float, seconds: float) -> int:
        """Store / evict filler blocks on random replicas for `seconds`; each step pushes."""
        import time

        end, steps = time.monotonic() + seconds, 0
        rids = list(self.sinks)
        while time.monotonic() < end:
            rid = self._rng.choice(rids)
            with self._lock:
                keys = tuple(os.urandom(16) for _ in range(blocks_per_step))
                for g in (0, 2):
                    self.sinks[rid].stored(g, keys)
                    self.caches[rid][g].extend(keys)
            self.publishers[rid].on_step()
            steps += 1
            time.sleep(step_s)
        return steps

    def resync_one(self, rid: str) -> float:
        """Time a full chunked resync of replica `rid` (through Ray, as a replica does it)."""
        import time

        t0 = time.perf_counter()
        self.publishers[rid].stop()
        self.publishers[rid].resync()
        return time.perf_counter() - t0

    def stop(self) -> None:
        for pub in self.publishers.values():
            pub.stop()
