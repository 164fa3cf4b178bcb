"""Small cache-core facts no other test pinned down: the scorer at the last candidate length and
with no attention group, a transfer's extent per group, pool events carrying their group, and a
block's repr. Written to kill mutants `make mutants` found surviving."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.events import AllBlocksCleared, BlockRemoved
from cache_service.global_index import GlobalIndex
from cache_service.hit_finders import DropRule
from cache_service.messages import BlockRecord, RecordKind
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.router import Router, RoutingPolicy
from cache_service.simulate import make_tokens, simulate
from tests.cache_service.helpers import make_layout, make_scenario


def route_held(groups, masks, prompt_len, held):
    """Route a `prompt_len`-token prompt to the one replica holding its first `held` tokens in
    every group (records with `masks` per block)."""
    coord = HybridCoordinator(make_layout(*groups), EagleMode.OFF)
    index = GlobalIndex(len(groups))
    index.add_replica("a")
    size = coord.layout.hash_block_size
    hashes = RequestBlockHashes(size, make_tokens(prompt_len, 1, 50)).hashes
    records = [BlockRecord(RecordKind.STORED, k, masks) for k in hashes[: held // size]]
    index.apply_batch("a", 0, len(records), records)
    return Router(index, coord, RoutingPolicy.HYBRID).route(hashes, prompt_len, {"a": 0})


def test_the_scorer_reaches_the_last_candidate_length_n_minus_1():
    # 65 tokens, alignment 16: the cap is 64 = 65 - 1, so a hit of 64 counts
    assert route_held(["full:16"], 0b1, 65, 64).expected_hit_tokens == 64
    assert route_held(["full:16"], 0b1, 64, 64).expected_hit_tokens == 48  # capped at 63


def test_a_layout_without_attention_groups_scores_mamba_hits_only():
    decision = route_held(["mamba:16"], 0b1, 100, 64)  # snapshots at 16, 32, 48, 64
    assert decision.expected_hit_tokens == 64
    assert [(e.replica_id, e.hit_tokens, e.attention_tokens) for e in decision.estimates] == [("a", 64, 0)]


def test_a_transfer_moves_what_each_group_needs_to_serve_the_hit():
    layout = make_layout("full:32", "mamba:64", "draft:16")
    look = HybridCoordinator(layout, EagleMode.DROP, drop_rule=DropRule.LOOKAHEAD)
    assert look.dropping_groups == frozenset({2})  # the draft group drops
    assert [look.serving_extent(g, 128) for g in range(3)] == [128, 128, 128 + 16]
    assert [look.serving_extent(g, 0) for g in range(3)] == [0, 0, 0]
    align = HybridCoordinator(layout, EagleMode.DROP, drop_rule=DropRule.ALIGNMENT)
    assert [align.serving_extent(g, 128) for g in range(3)] == [128, 128, 128 + 64]
    assert [HybridCoordinator(layout, EagleMode.OFF).serving_extent(g, 128) for g in range(3)] == [128] * 3


def test_pool_events_carry_the_pools_group():
    sink = EventSink("r")
    pool = BlockPool(4, group_id=2, events=sink)
    (block,) = pool.allocate(1)
    key = RequestBlockHashes(16, make_tokens(16, 0, 50)).hashes[0]
    pool.cache_block(block, key)
    pool.free([block])
    assert pool.evict(key)
    assert pool.reset_prefix_cache()
    events = sink.drain()[-2:]
    assert events == [BlockRemoved(events[0].seq, 2, (key,)), AllBlocksCleared(events[1].seq, 2)]


def test_touch_counts_every_reuse_and_skips_only_the_null_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a, b])
    assert pool.num_free_blocks == 3
    pool.touch([pool.null_block, a, b])  # the null block first: the others still taken
    pool.touch([a])
    assert (a.ref_cnt, b.ref_cnt, pool.null_block.ref_cnt, pool.num_free_blocks) == (2, 1, 1, 1)
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1


def test_a_block_shows_its_id_references_and_hash_prefix():
    pool = BlockPool(3)
    key = RequestBlockHashes(16, make_tokens(16, 0, 50)).hashes[0]
    (block,) = pool.allocate(1)
    assert repr(block) == f"CacheBlock(id={block.block_id}, ref=1, hash=-)"
    pool.cache_block(block, key)
    assert repr(block) == f"CacheBlock(id={block.block_id}, ref=1, hash={key.hex()[:8]})"


def test_simulate_uses_the_scenarios_seed_salt_and_retention():
    scenario = make_scenario(["full:16", "mamba:64"], 300, seed=3, cache_salt="tenant", retention="128")
    result = simulate(scenario)
    assert result.scenario is scenario and result.cold.explanation == [] == result.resend.explanation
    salted = RequestBlockHashes(16, make_tokens(300, 3, 32000), cache_salt="tenant").hashes
    unsalted = RequestBlockHashes(16, make_tokens(300, 3, 32000)).hashes
    assert salted[0] in result.cache.pools[0].cached and unsalted[0] not in result.cache.pools[0].cached
    assert result.resend.checkpoints == (128, 256)  # every 128 tokens, and R = 256
    assert result.resend.hit.hit_tokens == 256


def test_periodic_snapshot_positions_lie_in_0_to_n_inclusive():
    for policy in (make_retention("dense", 64), make_retention("64", 64)):
        assert list(policy.periodic_positions(127, 64)) == [64]
        assert list(policy.periodic_positions(128, 64)) == [64, 128]
    assert list(make_retention("128", 64).periodic_positions(383, 64)) == [128, 256]


def test_check_integrity_names_each_broken_invariant():
    for corrupt in (lambda p: setattr(p.null_block, "ref_cnt", 0),
                    lambda p: p._free.__setitem__(0, p.null_block)):
        pool = BlockPool(3)
        corrupt(pool)
        with pytest.raises(AssertionError, match="^null block$"):
            pool.check_integrity()
    pool = BlockPool(3)
    pool._free[1] = pool.blocks[2]
    with pytest.raises(AssertionError, match="^free queue holds foreign blocks$"):
        pool.check_integrity()


def test_purging_one_replica_clears_only_its_bits_and_counts_only_its_entries():
    index = GlobalIndex(2)
    keys = RequestBlockHashes(16, make_tokens(64, 5, 50)).hashes
    for r, held in (("a", keys[:3]), ("b", keys[1:2])):
        index.add_replica(r)
        index.apply_batch(r, 0, len(held), tuple(BlockRecord(RecordKind.STORED, k, 0b11) for k in held))
    assert index.purge("b") == 2  # one key in each of two groups
    assert index.holders == [dict.fromkeys(keys[:3], 0b01)] * 2
    assert index.mask_of(["a", "b"]) == 0b01 and index.mask_of(index.replicas.keys()) == 0b01


def test_boundaries_and_landings_with_an_alignment_of_one_token():
    # block size 1: R = 3 - 1 = 2, the final boundary 3; the alignment drop lands one token below
    # each, so 1 and 2 are reachable hits too; nothing at 0
    coord = HybridCoordinator(make_layout("full:1", "mamba:1"), EagleMode.DROP, drop_rule=DropRule.ALIGNMENT)
    planner = CheckpointPlanner(coord, make_retention("latest", 1))
    marks = planner.boundaries(3, 3)
    assert [m.position for m in marks] == [2, 3] and coord.reachable_hit_positions(marks) == (1, 2)
    assert planner.checkpoints(3, 3) == (1, 2, 3)
    assert [m.position for m in planner.boundaries(2, 2)] == [1, 2]


def test_the_replay_boundary_and_a_prompt_shorter_than_the_alignment():
    planner = CheckpointPlanner(HybridCoordinator(make_layout("full:16", "mamba:64")), make_retention("latest", 64))
    assert (planner.replay_boundary(65), planner.replay_boundary(64)) == (64, 0)
    assert planner.boundaries(10, 10) == [] and planner.checkpoints(10, 10) == ()


def test_an_empty_index_trusts_nobody():
    index = GlobalIndex(1)
    assert index.routable_mask() == 0 and index.mask_of(["x"]) == 0 and index.mask_of(index.replicas.keys()) == 0


def test_retention_values_at_their_edges():
    from cache_service.specs import SpecError

    assert make_retention("0", 64).name == "latest" and make_retention(" Latest ", 64).name == "latest"
    assert make_retention("1", 1).interval == 1
    for bad in ("00", "-64", "96"):
        with pytest.raises(SpecError, match="must be a positive multiple of the alignment 64"):
            make_retention(bad, 64)


def test_a_one_token_prompt_never_hits_even_at_alignment_one():
    assert route_held(["full:1"], 0b1, 1, 1).expected_hit_tokens == 0  # capped at N - 1 = 0
    assert route_held(["full:1"], 0b1, 3, 3).expected_hit_tokens == 2


def test_routing_lookups_skip_the_per_group_answers():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"))
    cache = LocalPrefixCache(coord, [40, 8])
    hashes = RequestBlockHashes(16, make_tokens(300, 1, 50))
    cache.store_prefix(hashes, 300, (256,))
    full = coord.find_longest_hit(hashes.hashes, 300, cache.lookup_view)
    fast = coord.find_longest_hit(hashes.hashes, 300, cache.lookup_view, per_group=False)
    assert full.hit_tokens == fast.hit_tokens == 256 and full.per_group_hits == (256, 256)
    assert fast.per_group_hits == ()


def test_the_alignment_drop_can_land_on_one_token():
    # alignment 1, 3-token prompt (cap 2): full blocks end at 1 and 2, a snapshot at 1. The
    # alignment rule serves L iff the full group serves L + 1: L = 1 (full serves 2), so the hit is 1
    from tests.cache_service.helpers import make_set_lookup

    coord = HybridCoordinator(make_layout("full:1", "mamba:1"), EagleMode.DROP, drop_rule=DropRule.ALIGNMENT)
    hashes = RequestBlockHashes(1, make_tokens(3, 0, 50))
    assert coord.find_longest_hit(hashes.hashes, 3, make_set_lookup(hashes, [{1, 2}, {1}])).hit_tokens == 1
