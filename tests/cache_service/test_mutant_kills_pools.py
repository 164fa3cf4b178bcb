"""Block pools and the local cache: their error messages, defaults, and what `store_prefix`
reports when a pool has no room. Written to kill mutants `make mutants` found surviving."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.block_pool import BlockPool, PoolExhaustedError
from cache_service.local_cache import StoreResult
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import make_layout

KEY = RequestBlockHashes(16, make_tokens(16, 0, 50)).hashes[0]


def test_pool_errors_say_what_went_wrong():
    with pytest.raises(ValueError, match=r"^a block pool needs at least 2 blocks \(one is the null block\), got 1$"):
        BlockPool(1)
    pool = BlockPool(3, group_id=4)
    with pytest.raises(PoolExhaustedError, match="^group 4: 3 blocks asked, 2 free$"):
        pool.allocate(3)
    with pytest.raises(ValueError, match="^the null block is never cached$"):
        pool.cache_block(pool.null_block, KEY)
    (block,) = pool.allocate(1)
    pool.free([block])
    double = rf"^double free of CacheBlock\(id={block.block_id}, ref=0, hash=-\) in group 4$"
    with pytest.raises(ValueError, match=double):
        pool.free([block])


def test_pool_defaults_group_0_and_no_events():
    pool = BlockPool(3)
    assert pool.group_id == 0 and pool.events.enabled is False
    (block,) = pool.allocate(1)
    pool.cache_block(block, KEY)
    pool.free([block])
    pool.evict(KEY)
    assert pool.events.drain() == []


def test_freeing_skips_only_the_null_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([pool.null_block, a, b])
    assert pool.num_free_blocks == 3 and pool.null_block.ref_cnt == 1


def test_the_local_cache_needs_one_size_per_group_and_publishes_events():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
    with pytest.raises(ValueError, match="^one pool size per group is needed$"):
        LocalPrefixCache(coord, [10])
    cache = LocalPrefixCache(coord, [40, 8])
    assert isinstance(cache.events, EventSink) and cache.events.enabled
    hashes = RequestBlockHashes(16, make_tokens(300, 1, 50))
    assert cache.store_prefix(hashes, 300, (256,)) == StoreResult(True, (18, 1), (0, 0))
    assert len(cache.events.drain()) == 18 + 1  # one stored event per block and page, nothing evicted
    # a second, cold copy of the prompt: its blocks stay private (first copy wins), no events
    assert cache.store_prefix(hashes, 300, (256,)) == StoreResult(True, (0, 0), (0, 0))
    assert cache.events.drain() == []
    cache.check_integrity()


def test_store_prefix_stores_nothing_when_the_prompt_does_not_fit_at_once():
    # the engine's admission: every page of the prompt plus a working Mamba page and a spare
    # one for a snapshot; a pool one page short stores nothing (not a partial prefix)
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
    hashes = RequestBlockHashes(16, make_tokens(300, 2, 50))
    one_page = LocalPrefixCache(coord, [40, 2])  # the mamba pool: the null block and one page
    assert one_page.store_prefix(hashes, 300, (256,)) == StoreResult(False, (0, 0), (0, 0))
    short = LocalPrefixCache(coord, [19, 3])  # 18 usable blocks for 19 (the last one partial)
    assert short.store_prefix(hashes, 300, (256,)) == StoreResult(False, (0, 0), (0, 0))
    assert [p.num_cached_blocks for p in (*one_page.pools, *short.pools)] == [0, 0, 0, 0]
    fits = LocalPrefixCache(coord, [20, 3])
    assert fits.store_prefix(hashes, 300, (64, 128, 256)) == StoreResult(True, (18, 3), (0, 0))
    # two usable pages: the working state and one retained snapshot, the most valuable (256)
    assert set(fits.pools[1].cached) == {hashes.prefix_hash(256)}


def test_retained_block_ends_at_the_edges():
    from cache_service.coordinator import Boundary
    from cache_service.group_managers import retained_block_ends
    from cache_service.specs import parse_group_spec

    assert retained_block_ends(parse_group_spec("full:1"), 3, ()) == [1, 2, 3]
    assert retained_block_ends(parse_group_spec("full:16"), 47, ()) == [16, 32]
    # Mamba: a page per checkpoint on a page boundary (kills x_retained_block_ends__mutmut_3, _4, _5)
    assert retained_block_ends(parse_group_spec("mamba:64"), 300, (64, 65, 100, 128)) == [64, 128]
    # window 18 at 64: the tail [47, 64) starts in block 2 ([32, 48)): blocks ending at 48 and 64
    assert retained_block_ends(parse_group_spec("sliding_window:16:18"), 64, (64,)) == [48, 64]
    assert retained_block_ends(parse_group_spec("sliding_window:1:4"), 2, (2,)) == [1, 2]
    # the lookahead block [64, 80) is kept when it ends exactly at the computed tokens
    assert retained_block_ends(parse_group_spec("sliding_window:16:18"), 80, (64,), lookahead=True) == [48, 64, 80]
    assert retained_block_ends(parse_group_spec("sliding_window:16:18"), 79, (64,), lookahead=True) == [48, 64]
    # a landing stays at a boundary whose dropping group's block [128, 144) ends exactly at the extent
    coord = HybridCoordinator(make_layout("full:16", "mamba:64", "draft:16"), EagleMode.DROP)
    assert coord.landing(Boundary(128, 144)) == 128 and coord.landing(Boundary(128, 143)) == 64


def test_integrity_check_names_an_empty_block_behind_a_cached_one():
    # the order `free` keeps (empty blocks at the head) is what allocation relies on; a pool whose
    # queue lost it (here forced by moving the empty block to the tail) fails the check by name
    pool = BlockPool(4)
    b1, b2, _ = pool.allocate(3)
    pool.cache_block(b1, RequestBlockHashes(16, make_tokens(16, 0, 50)).prefix_hash(16))
    pool.free([b1, b2])
    pool.check_integrity()
    pool._free.move_to_end(b2.block_id)
    message = r"^an empty free block waits behind a cached one \(it must be reused first\)$"
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
