"""Retained Mamba checkpoints under a byte budget: the least valuable goes (reuse, recency,
tokens saved per byte), a snapshot worth less than every retained one is not taken, working
states are never evicted."""

from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import HybridCoordinator
from cache_service.group_managers import NullPageBackend
from cache_service.mamba_manager import MambaManager
from cache_service.simulate import make_tokens
from cache_service.specs import CacheLayout, FullAttentionSpec, MambaSpec

LAYOUT = CacheLayout((FullAttentionSpec(16), MambaSpec(64)))


def make_manager(num_pages: int, budget: int | None) -> MambaManager:
    coord = HybridCoordinator(LAYOUT)
    return MambaManager(1, LAYOUT.groups[1], BlockPool(num_pages, 1), coord, NullPageBackend(),
                        max_retained_pages=budget, page_size_bytes=1000)


def hashes(seed: int, n: int = 512) -> RequestBlockHashes:
    return RequestBlockHashes(16, make_tokens(n, seed, 1000))


def test_budget_evicts_the_least_valuable_checkpoint():
    m = make_manager(10, budget=3)
    a, b, c, d = hashes(1), hashes(2), hashes(3), hashes(4)
    assert m.snapshot(b, 0, 192) and m.snapshot(a, 0, 128) and m.snapshot(c, 0, 256)
    for i in range(2):  # a's checkpoint is reused twice (restored into a request's working page)
        m.restore(f"r{i}", a, 128)
        m.free(f"r{i}")
    assert m.num_retained == 3 and m.num_retained_bytes == 3000
    # value = position / bytes * (1 + reuses) / (1 + age / 64): a 128*3, b 192, c 256 -> b goes
    # (LRU would have taken b too; the next test has LRU and value disagree)
    assert m.snapshot(d, 0, 320)
    assert set(m.pool.cached) == {a.prefix_hash(128), c.prefix_hash(256), d.prefix_hash(320)}
    assert m.num_evictions == 1 and m.num_retained == 3
    # a fresh checkpoint at 64 is worth less than every retained one: not taken
    assert not m.snapshot(hashes(5), 0, 64)
    assert m.num_snapshots_skipped == 1 and hashes(5).prefix_hash(64) not in m.pool.cached
    m.pool.check_integrity()


def test_recency_lowers_value_and_reuse_raises_it():
    m = make_manager(10, budget=2)
    old, new = hashes(1), hashes(2)
    m.snapshot(old, 0, 256)
    m.clock += 300  # many ticks pass (other checkpoints made and reused elsewhere)
    m.snapshot(new, 0, 192)
    assert m.snapshot(hashes(3), 0, 200 // 64 * 64)  # 192, fresh: beats the stale 256
    assert old.prefix_hash(256) not in m.pool.cached and new.prefix_hash(192) in m.pool.cached


def test_working_states_are_never_evicted_and_pool_pressure_evicts_by_value():
    m = make_manager(6, budget=None)  # 5 usable pages, no budget: only pool pressure evicts
    a, b, c = hashes(1), hashes(2), hashes(3)
    m.snapshot(b, 0, 448)  # least recently used: what the pool's LRU would evict
    m.snapshot(a, 0, 64)  # cheapest: what goes
    m.snapshot(c, 0, 256)
    m.restore("w1", hashes(9), 0)
    m.restore("w2", hashes(9), 0)  # 5 pages: 3 retained, 2 working; none free and uncached
    m.restore("w3", hashes(9), 0)  # needs one: the cheapest checkpoint (a, at 64) goes, not LRU
    assert a.prefix_hash(64) not in m.pool.cached and m.num_evictions == 1
    assert {b.prefix_hash(448), c.prefix_hash(256)} <= set(m.pool.cached)
    working = {m.working_page(r) for r in ("w1", "w2", "w3")}
    assert len(working) == 3 and all(m.pool.blocks[p].ref_cnt == 1 for p in working)
    m.pool.check_integrity()
