import pytest

from cache_service import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    EventSink,
    PoolExhaustedError,
)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_allocation_order_and_null_block():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.null_block.block_id == 0 and pool.num_free_blocks == 1
    assert not pool.can_allocate(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    pool.free([pool.null_block])  # ignored, never freed
    pool.check_integrity()


def test_lru_eviction_of_free_cached_blocks_emits_removed_events():
    sink = EventSink("r0")
    pool = BlockPool(4, group_id=2, events=sink)
    a, b, c = pool.allocate(3)
    for block, i in ((a, 1), (b, 2), (c, 3)):
        assert pool.cache_block(block, h(i))
    pool.free([c, b, a])  # tail-first: c becomes least recently used
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    (x,) = pool.allocate(1)
    assert x is c and c.block_hash is None and pool.get_cached(h(3)) is None
    pool.check_integrity()
    events = sink.drain()
    assert [type(e) for e in events] == [BlockStored] * 3 + [BlockRemoved]
    assert [e.seq for e in events] == [0, 1, 2, 3]
    assert events[-1].block_hashes == (h(3),) and events[-1].group_id == 2


def test_touch_reuses_cached_block_and_protects_it_from_eviction():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(7))
    pool.free([a])
    hit = pool.get_cached(h(7))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 1
    (other,) = pool.allocate(1)
    assert other is not a and pool.get_cached(h(7)) is a
    pool.check_integrity()


def test_duplicate_hash_keeps_first_copy_and_double_free_raises():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1))
    assert not pool.cache_block(b, h(1))
    assert b.block_hash is None
    pool.free([a, b])
    with pytest.raises(ValueError):
        pool.free([a])
    with pytest.raises(ValueError):
        pool.cache_block(pool.null_block, h(9))


def test_evict_and_reset():
    sink = EventSink()
    pool = BlockPool(4, events=sink)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    assert not pool.reset_prefix_cache()  # blocks in use
    assert not pool.evict(h(1))  # in use
    pool.free([a, b])
    assert pool.evict(h(1)) and not pool.evict(h(1))
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0
    kinds = [type(e) for e in sink.drain()]
    assert kinds == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    a.ref_cnt = 0  # broken: not in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
