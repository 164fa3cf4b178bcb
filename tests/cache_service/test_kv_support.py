"""KV valued jointly with Mamba states: `KvSupport`'s live-node counts over the prefix tree, and
`BlockPool`'s spare queue they steer (cached attention blocks above every retained state of their
prefix are evicted right after the empty blocks, before any block a hit can still use).

Wrong changes these catch: anchoring a state at its own position when a group drops (the block at
L that an EAGLE-drop hit needs would go spare), walking up from the anchor past a live node or
stopping too early (a shared prefix left spare while a sibling's state needs it), removing a
node while another state still anchors at or above it, counting the same state twice, allocation
taking kept blocks before spare ones (or spare before empty), `reconsider` ignoring a change, a
cached block re-cached onto a free one staying at the LRU head, and `lru` getting the hook."""

from __future__ import annotations

import pytest

from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import EagleMode, HybridCoordinator
from cache_service.eviction import EvictionConfig
from cache_service.group_managers import GroupManagers
from cache_service.kv_support import KvSupport
from cache_service.lifecycle import settle
from cache_service.specs import CacheLayout, parse_group_spec


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chain(tokens: list[int]) -> RequestBlockHashes:
    return RequestBlockHashes(16, tokens)


def live(support: KvSupport, hashes: RequestBlockHashes) -> list[bool]:
    return [support.keeps(x) for x in hashes.hashes]


# ---- KvSupport ----------------------------------------------------------------------------------
def test_a_state_makes_its_prefix_usable_and_nothing_above_it():
    support = KvSupport([])
    a = chain(list(range(128)))  # 8 hash units
    support.stored(1, a.prefix_hash(64), a, 64)
    assert live(support, a) == [True] * 4 + [False] * 4 and support.num_live_nodes == 4
    support.stored(1, a.prefix_hash(128), a, 128)
    assert live(support, a) == [True] * 8
    support.removed(1, a.prefix_hash(64))  # the state at 128 still needs the blocks below 64
    assert live(support, a) == [True] * 8
    support.removed(1, a.prefix_hash(128))
    assert live(support, a) == [False] * 8 and support.num_live_nodes == 0


def test_under_an_eagle_drop_the_block_starting_at_the_state_stays_usable():
    support = KvSupport([], reach_tokens=16)
    a = chain(list(range(128)))
    support.stored(1, a.prefix_hash(64), a, 64)
    assert live(support, a) == [True] * 5 + [False] * 3
    support.stored(1, a.prefix_hash(128), a, 128)  # reach past the prompt's end: capped at its last unit
    assert live(support, a) == [True] * 8
    support.removed(1, a.prefix_hash(128))
    assert live(support, a) == [True] * 5 + [False] * 3


def test_a_shared_prefix_stays_usable_while_any_branch_holds_a_state():
    support = KvSupport([])
    a, b = chain(list(range(96))), chain(list(range(32)) + [999] * 64)
    assert a.hashes[:2] == b.hashes[:2] and a.hashes[2] != b.hashes[2]
    support.stored(1, a.prefix_hash(96), a, 96)
    support.stored(1, b.prefix_hash(96), b, 96)
    assert support.num_live_nodes == 2 + 4 + 4
    support.removed(1, a.prefix_hash(96))
    assert live(support, a) == [True, True] + [False] * 4 and live(support, b) == [True] * 6
    support.removed(1, b.prefix_hash(96))
    assert support.num_live_nodes == 0


def test_each_group_counts_its_own_states_once_and_unknown_removals_are_ignored():
    support = KvSupport([])
    a = chain(list(range(64)))
    key = a.prefix_hash(64)
    support.stored(1, key, a, 64)
    support.stored(1, key, a, 64)  # the same state again: no second count
    support.stored(2, key, a, 64)  # another Mamba group's state at the same place
    support.removed(1, key)
    assert live(support, a) == [True] * 4
    support.removed(2, key)
    support.removed(2, key)
    support.removed(3, h(7))
    assert support.num_live_nodes == 0


def test_a_state_registered_without_its_prefix_keeps_its_own_node_only():
    support = KvSupport([])
    a = chain(list(range(64)))
    support.stored(1, a.prefix_hash(64), None, 0)  # adopted from a transfer
    assert live(support, a) == [False, False, False, True]
    support.removed(1, a.prefix_hash(64))
    assert support.num_live_nodes == 0


# ---- BlockPool's spare queue --------------------------------------------------------------------
def cached_pool(n: int, kept: set[bytes]) -> tuple[BlockPool, list]:
    pool = BlockPool(n + 2)
    pool.keeps = kept.__contains__
    blocks = pool.allocate(n)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h(i))
    return pool, blocks


def test_free_blocks_no_hit_can_use_are_taken_after_the_empty_ones_and_before_any_kept_one():
    pool, blocks = cached_pool(4, {h(0), h(2)})
    pool.free(blocks)
    assert (pool.num_free_blocks, pool.num_spare_blocks, pool.num_free_empty_blocks) == (5, 2, 1)
    pool.check_integrity()
    got = pool.allocate(4)
    # the empty block, then spare ones in the order they went spare, then kept ones in LRU order
    assert [b.block_id for b in got] == [5, 2, 4, 1]
    assert set(pool.cached) == {h(2)}
    pool.check_integrity()


def test_reconsider_moves_a_free_block_between_the_queues_when_the_answer_changes():
    kept = {h(0), h(1)}
    pool, blocks = cached_pool(2, kept)
    pool.free(blocks)
    assert pool.num_spare_blocks == 0
    kept.discard(h(0))
    pool.reconsider(h(0))
    assert pool.num_spare_blocks == 1
    pool.check_integrity()
    (first, _) = pool.allocate(2)
    assert first.block_id == 3  # the empty one
    kept.add(h(0))
    pool.reconsider(h(0))  # no longer cached: nothing to move
    pool.check_integrity()


def test_a_block_going_spare_comes_back_to_the_kept_tail_and_touch_and_evict_leave_no_stale_entry():
    kept: set[bytes] = set()
    pool, blocks = cached_pool(3, kept)
    pool.free(blocks)
    assert pool.num_spare_blocks == 3
    kept.add(h(1))
    pool.reconsider(h(1))  # kept now, at the kept queue's tail
    pool.touch([blocks[2]])  # a spare block taken by a hit
    assert pool.num_spare_blocks == 1 and blocks[2].ref_cnt == 1
    assert pool.evict(h(0))  # the last spare one: now empty, reused first
    pool.check_integrity()
    assert [b.block_id for b in pool.allocate(3)] == [1, 4, 2]
    pool.free([blocks[2]])
    pool.check_integrity()


def test_without_a_hook_every_cached_block_is_kept_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h(i))
    pool.free(blocks)
    assert pool.num_spare_blocks == 0
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]


def test_caching_onto_a_free_empty_block_puts_it_at_the_kept_tail():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(0))
    pool.free([a, b])  # b is empty: at the head; a cached
    pool.cache_block(b, h(1))  # the pool learns b's content while it is free: most recent now
    pool.check_integrity()
    assert [x.block_id for x in pool.allocate(3)] == [3, 1, 2]


def test_reset_forgets_the_spare_blocks_too():
    pool, blocks = cached_pool(3, {h(0)})
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert (pool.num_spare_blocks, pool.num_cached_blocks, pool.num_free_empty_blocks) == (0, 0, 4)
    pool.check_integrity()


@pytest.mark.parametrize("corrupt, message", [
    (lambda p, b: p._spare.__setitem__(b[0].block_id, b[0]), "a block in both free queues"),
    (lambda p, b: p._spare.__setitem__(4, p._free.pop(4)),
     "an empty block in the spare queue"),
    (lambda p, b: p._spare.__setitem__(b[0].block_id, p._free.pop(b[0].block_id)), "a kept block in the spare queue"),
    (lambda p, b: p._free.__setitem__(b[1].block_id, p._spare.pop(b[1].block_id)), "a spare block in the kept queue"),
])
def test_check_integrity_catches_a_corrupt_spare_queue(corrupt, message):
    pool, blocks = cached_pool(3, {h(0)})
    pool.free(blocks)
    pool.check_integrity()
    corrupt(pool, blocks)
    with pytest.raises(AssertionError, match=f"^{message}$"):
        pool.check_integrity()


def test_check_integrity_catches_spare_blocks_without_a_hook():
    pool, blocks = cached_pool(2, set())
    pool.free(blocks)
    pool.keeps = None
    with pytest.raises(AssertionError, match="^spare blocks without a keeps hook$"):
        pool.check_integrity()


# ---- wired through GroupManagers ----------------------------------------------------------------
def groups_with(policy: str, eagle: EagleMode = EagleMode.OFF) -> GroupManagers:
    layout = CacheLayout((parse_group_spec("full:16"), parse_group_spec("mamba:64")))
    return GroupManagers(HybridCoordinator(layout, eagle), [BlockPool(40, 0), BlockPool(12, 1)],
                         eviction=EvictionConfig(policy))


@pytest.mark.parametrize("policy", ["value", "marconi", "lru"])
def test_blocks_above_the_retained_state_go_spare_when_the_request_ends_unless_lru(policy):
    groups = groups_with(policy)
    full, mamba = groups.managers
    hashes = chain(list(range(200)))
    groups.admit("r", hashes, 0, 200)
    assert settle(groups, "r", hashes, [200, 200], working_state_at=128, free=True) == [12, 1]
    assert set(mamba.pool.cached) == {hashes.prefix_hash(128)}
    full.pool.check_integrity()
    if policy == "lru":
        assert groups.support is None and full.pool.keeps is None and full.pool.num_spare_blocks == 0
        return
    assert full.pool.num_spare_blocks == 4  # the blocks ending at 144..192
    assert [full.pool.keeps(hashes.prefix_hash(16 * i)) for i in range(1, 13)] == [True] * 8 + [False] * 4
    # the state leaves: every block of the prompt is spare now
    mamba._evict(mamba.pool.cached[hashes.prefix_hash(128)])
    assert full.pool.num_spare_blocks == 12 and groups.support.num_live_nodes == 0
    full.pool.check_integrity()


def test_under_eagle_drop_the_support_reaches_one_alignment_unit_past_the_state():
    groups = groups_with("value", EagleMode.DROP)
    full, mamba = groups.managers
    hashes = chain(list(range(200)))
    groups.admit("r", hashes, 0, 200)
    settle(groups, "r", hashes, [200, 200], working_state_at=128, free=True)
    reach = groups.coordinator.alignment
    assert groups.support.reach_tokens == reach > 0
    kept = [full.pool.keeps(hashes.prefix_hash(16 * i)) for i in range(1, 13)]
    assert kept == [16 * i <= 128 + reach for i in range(1, 13)]


# ---- exact edges (mutation testing, 6 Dec) ------------------------------------------------------
def test_without_a_drop_a_state_keeps_only_the_units_wholly_below_it():
    support = KvSupport([])  # default reach: none
    a = chain(list(range(64)))
    support.stored(1, a.prefix_hash(48), a, 63)  # the unit ending at 64 is not wholly below 63
    assert live(support, a) == [True, True, True, False]
    assert groups_with("value").support.reach_tokens == 0


def test_a_state_at_position_0_anchors_on_its_own_node_even_with_its_hashes():
    support = KvSupport([])
    a = chain(list(range(64)))
    support.stored(1, a.prefix_hash(32), a, 0)
    assert live(support, a) == [False, True, False, False]
    support.removed(1, a.prefix_hash(32))
    assert support.num_live_nodes == 0


def test_a_spare_block_goes_back_to_the_kept_queue_when_a_state_comes_to_need_it():
    pool = BlockPool(4)
    support = KvSupport([pool])
    a = chain(list(range(32)))
    blocks = pool.allocate(2)
    for i, block in enumerate(blocks):
        pool.cache_block(block, a.hashes[i])
    pool.free(blocks)
    assert pool.num_spare_blocks == 2
    support.stored(1, a.prefix_hash(16), a, 16)
    assert pool.num_spare_blocks == 1 and pool._spare.keys() == {blocks[1].block_id}
    pool.check_integrity()


def test_reconsider_with_an_unchanged_answer_leaves_both_queues_alone():
    pool, blocks = cached_pool(2, {h(0)})
    pool.free(blocks)
    pool.reconsider(h(0))  # kept, still kept
    pool.reconsider(h(1))  # spare, still spare
    assert (pool.num_spare_blocks, pool.num_free_blocks) == (1, 3)
    pool.check_integrity()


def test_caching_onto_a_free_empty_block_counts_one_empty_block_less_and_asks_the_hook():
    pool = BlockPool(6)
    pool.keeps = {h(0)}.__contains__
    a, b = pool.allocate(2)
    pool.free([a, b])  # 5 empty blocks
    pool.cache_block(a, h(0))
    pool.cache_block(b, h(1))  # not kept: spare at once
    assert (pool.num_free_empty_blocks, pool.num_spare_blocks) == (3, 1)
    pool.check_integrity()


def test_touching_a_free_empty_block_counts_one_empty_block_less():
    pool = BlockPool(4)
    pool.touch([pool.blocks[2]])
    assert pool.num_free_empty_blocks == 2 and pool.blocks[2].ref_cnt == 1
    pool.check_integrity()


def test_check_integrity_names_a_wrong_count_of_empty_free_blocks():
    pool, blocks = cached_pool(2, {h(0)})
    pool.free(blocks)
    pool._num_free_empty += 1
    with pytest.raises(AssertionError, match="^count of empty free blocks wrong$"):
        pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "marconi", "value"])
def test_each_mamba_group_gets_the_configured_policy_with_its_page_bytes(policy):
    layout = CacheLayout((parse_group_spec("full:16"), parse_group_spec("mamba:64")))
    groups = GroupManagers(HybridCoordinator(layout, EagleMode.OFF), [BlockPool(40, 0), BlockPool(12, 1)],
                           mamba_options={"page_size_bytes": 4096}, eviction=EvictionConfig(policy))
    assert groups.managers[1].eviction.name == policy and groups.managers[1].eviction.page_bytes == 4096
    assert groups_with(policy).managers[1].eviction.page_bytes == 1


def test_pages_cached_and_evicted_behind_the_managers_back_reach_the_support():
    groups = groups_with("value")
    mamba = groups.managers[1]
    a = chain(list(range(64)))
    key = a.prefix_hash(64)
    (page,) = mamba.pool.allocate(1)
    mamba.pool.cache_block(page, key)  # a transfer registers a state in the pool
    mamba.pool.free([page])
    mamba._adopt()
    assert live(groups.support, a) == [False, False, False, True]
    assert mamba.pool.evict(key)
    mamba._adopt()
    assert groups.support.num_live_nodes == 0


def test_a_state_at_position_1_reaches_past_itself_under_a_drop():
    support = KvSupport([], reach_tokens=16)
    a = RequestBlockHashes(1, list(range(32)))  # one token per hash unit
    support.stored(1, a.prefix_hash(1), a, 1)
    assert live(support, a) == [True] * 17 + [False] * 15


def test_a_state_below_the_first_whole_hash_unit_anchors_on_its_own_node():
    """Regression (found by mutation testing): a position inside the first hash unit, no reach,
    anchored on the chain's last node without counting it, so its removal raised KeyError."""
    support = KvSupport([])
    a = chain(list(range(64)))
    key = a.prefix_hash(16)
    support.stored(1, key, a, 8)
    assert support.keeps(key) and support.num_live_nodes == 1
    support.removed(1, key)
    assert support.num_live_nodes == 0
