"""One publication implementation: the trace simulator's replicas publish what the engine's
group managers publish, page for page.

The engine runs a prefill chunk by chunk through `GroupManagers` (admission restores the hit and
takes the first chunk; every chunk grows, publishes its complete blocks and, when it ends at a
checkpoint, snapshots the Mamba state; the request frees everything when it ends). The same
request history through a trace-simulator replica (`SimReplica.publish`) must leave the same
pools: the same cached keys in the same blocks, and the same free-queue (eviction) order.

Wrong changes these tests catch:
- a second publication path in the simulator, e.g. the old `SimReplica._store` /
  `LocalPrefixCache.store_prefix`, which took pages only for the keys not cached yet: a request
  whose attention match runs past its hit recomputes those blocks in the engine, in fresh pages,
  and under pressure that evicts other blocks; the shortcut kept them (pools differ below);
- Mamba snapshots taken outside the manager (LRU instead of its value eviction, or without the
  working page a running request holds);
- any module of `cache_service/` (or `bench/`) caching blocks or walking retained block ends
  itself instead of calling the managers (the structural test).
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import EagleMode, HybridCoordinator
from cache_service.eviction import EvictionConfig
from cache_service.group_managers import GroupManagers
from cache_service.local_cache import PoolLookup
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.specs import CacheLayout, parse_group_spec
from cache_service.trace_sim.replica import SimReplica

ROOT = Path(__file__).resolve().parents[2]


def engine_prefill(groups: GroupManagers, hashes: RequestBlockHashes, hit: int, n: int, checkpoints) -> None:
    """The engine's sequence of manager calls for one request's prefill (`workers/engine`), with
    a chunk size above every prompt: chunks end at the checkpoints past the hit and at N."""
    rid = "engine"
    stops = sorted({c for c in checkpoints if hit < c < n} | {n})
    assert groups.can_admit(rid, hashes, hit, stops[0], spare_pages=1)
    groups.admit(rid, hashes, hit, stops[0])
    (mamba,) = groups.of_kind("mamba")
    for end in stops:
        assert groups.can_grow(rid, end)
        groups.grow(rid, end)
        groups.publish(rid, hashes, [end] * len(groups.managers), checkpoints)
        if end in checkpoints:
            mamba.snapshot(hashes, mamba.working_page(rid), end)
    groups.free(rid)


def pool_state(pool: BlockPool) -> tuple[dict, list[int]]:
    return {key: block.block_id for key, block in pool.cached.items()}, list(pool._free)


def history(seed: int) -> list[list[int]]:
    """Follow-up turns, resends and siblings of recent prompts (siblings share a prefix that
    mostly ends off a snapshot, so the attention match runs past the hit), and unrelated
    prompts that push the pools to evict."""
    rng = random.Random(seed)

    def fresh(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(rng.randrange(lo, hi))]

    prompts = [fresh(100, 300)]
    for _ in range(30):
        recent = rng.choice(prompts[-3:])
        kind = rng.choice(("follow-up", "resend", "sibling", "unrelated"))
        if kind == "follow-up":
            prompts.append(recent + fresh(10, 150))
        elif kind == "resend":
            prompts.append(list(recent))
        elif kind == "sibling":
            prompts.append(recent[: rng.randrange(len(recent) // 3, len(recent))] + fresh(1, 150))
        else:
            prompts.append(fresh(100, 300))
    return [p[:600] for p in prompts]


@pytest.mark.parametrize("eviction", ["value", "lru", "marconi:1"])
@pytest.mark.parametrize("eagle", [EagleMode.OFF, EagleMode.DROP, EagleMode.LOSSLESS])
def test_a_simulated_replica_leaves_the_pools_the_engines_managers_leave(eagle, eviction):
    """... with the same eviction policy object type (one per Mamba pool), in every EAGLE mode:
    the engine's managers and the simulated replica evict the same states in the same order."""
    groups = ["full:16", "mamba:64"] + (["draft:16"] if eagle is not EagleMode.OFF else [])
    layout = CacheLayout(tuple(parse_group_spec(g) for g in groups))
    sizes = (70, 7, 70)[: len(groups)]  # tight: the ~24 prompts publish far more than 69 blocks and 6 snapshots
    config = EvictionConfig(eviction)
    for seed in range(3):
        coord = HybridCoordinator(layout, eagle)
        planner = CheckpointPlanner(coord, make_retention("latest", layout.alignment))
        replica = SimReplica("r", coord, planner, sizes, index=None, eviction=config)
        pools = [BlockPool(n, g) for g, n in enumerate(sizes)]
        engine = GroupManagers(coord, pools, eviction=config)
        evicted = 0
        num_hits = 0
        for tokens in history(seed):
            hashes = RequestBlockHashes(layout.hash_block_size, tokens)
            n = len(tokens)
            hit = replica.lookup(hashes, n)
            assert coord.find_longest_hit(hashes.hashes, n, PoolLookup(pools)).hit_tokens == hit.hit_tokens
            junctions = coord.junctions(hit)
            replica.publish(hashes, hit.hit_tokens, n, junctions)
            engine_prefill(engine, hashes, hit.hit_tokens, n, planner.checkpoints(n, n, junctions))
            for g in range(len(sizes)):
                assert pool_state(replica.cache.pools[g]) == pool_state(pools[g]), (seed, g)
            (sim_mamba,), (engine_mamba,) = replica.cache.groups.of_kind("mamba"), engine.of_kind("mamba")
            assert sim_mamba.num_evictions == engine_mamba.num_evictions
            assert dict(sim_mamba.eviction.known()) == dict(engine_mamba.eviction.known())
            evicted = sim_mamba.num_evictions
            num_hits += hit.hit_tokens > 0
        assert num_hits >= 3  # the history reuses prefixes ...
        assert all(s > n for s, n in zip(replica.num_stored_blocks, sizes))  # ... and evicts
        assert evicted >= 5  # Mamba states by the policy
        assert replica.num_refused_prefills == 0


# where blocks are cached for publication, and re-cached when the host tier gives a page back
PUBLISHERS = {"attention_managers.py", "group_managers.py", "mamba_manager.py", "promotion.py"}


def test_only_the_group_managers_cache_blocks_or_walk_retained_block_ends():
    """Structural: outside the managers (and the pool itself) nothing in `cache_service/` or
    `bench/` calls `cache_block` or `retained_block_ends`: a simulation that publishes on its own
    would have to (the old `store_prefix` and `SimReplica._store` did both)."""
    offenders = []
    for path in [*sorted((ROOT / "cache_service").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]:
        if path.name in PUBLISHERS or path.name == "block_pool.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in ("cache_block", "retained_block_ends"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert offenders == []


def test_a_hit_evicted_before_its_prefill_ends_is_restored_from_what_is_still_cached():
    """The simulator looks a hit up when a request is served and publishes when its prefill
    ends; the engine pins the hit's pages in between, the simulator cannot. If another
    publication evicted them meanwhile, publication restores what is still cached instead of
    failing on a missing page (catches: dropping the `holds_hit` check in `SimReplica.publish`)."""
    layout = CacheLayout((parse_group_spec("full:16"), parse_group_spec("mamba:64")))
    coord = HybridCoordinator(layout, EagleMode.OFF)
    planner = CheckpointPlanner(coord, make_retention("latest", layout.alignment))
    replica = SimReplica("r", coord, planner, (40, 4), index=None)
    rng = random.Random(7)
    first = [rng.randrange(1000) for _ in range(256)]
    follow_up = RequestBlockHashes(16, first + [rng.randrange(1000) for _ in range(200)])
    replica.publish(RequestBlockHashes(16, first), 0, 256, ())
    hit = replica.lookup(follow_up, 456).hit_tokens
    assert hit == 256
    other = RequestBlockHashes(16, [rng.randrange(1000) for _ in range(600)])
    replica.publish(other, 0, 600, ())  # 38 blocks of 39: evicts the first prompt's blocks
    assert not replica.cache.groups.holds_hit(follow_up, hit)
    result = replica.publish(follow_up, hit, 456, ())
    assert result.admitted and result.num_stored_blocks[0] == 456 // 16
    assert replica.lookup(follow_up, 457).hit_tokens == 448  # its own final boundary
    replica.cache.check_integrity()
