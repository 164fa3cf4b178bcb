"""Retained Mamba checkpoints under a byte budget, with the default `value` eviction: the least
valuable goes (reuse, recency in requests, FLOPs saved per byte), a snapshot worth less than every
retained one is not taken, working states are never evicted."""

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
    # value = gain / bytes * (1 + reuses) * exp(-age / tau), age in requests (2 restores so far):
    # a 128 * 3 used now, b 192 and c 256 two requests old (tau >= 16) -> b goes
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
    for i in range(100):  # many requests pass (tau stays at its prior of 64 requests: no reuse yet)
        m.restore(f"q{i}", hashes(100 + i), 0)
        m.free(f"q{i}")
    m.snapshot(new, 0, 192)
    assert m.snapshot(hashes(3), 0, 192)  # fresh: beats the stale 256 (e^-100/64 of its worth)
    assert old.prefix_hash(256) not in m.pool.cached and new.prefix_hash(192) in m.pool.cached


def test_snapshots_do_not_age_retained_states():
    """The old rule counted age in snapshots: one request's own fine-grid snapshots aged the
    shared system prompt's state out. Age is counted in requests now: a retained state's worth is
    the same after one snapshot of a request as after seven."""
    m = make_manager(10, budget=2)
    shared, busy = hashes(1), hashes(2)
    m.snapshot(shared, 0, 256)
    for i in range(3):  # a system prompt's state: it has served three hits, one per request
        m.restore(f"s{i}", shared, 256)
        m.free(f"s{i}")
    m.restore("r", busy, 0)  # one request ...
    key = shared.prefix_hash(256)
    worth = m.eviction.worth(key)
    for position in range(64, 512, 64):  # ... snapshots a dense grid: 7 snapshots, one tick
        m.snapshot(busy, 0, position)
        assert m.eviction.worth(key) == worth
    # each grid state (no hit served below it) is worth its whole prefix, so it replaces the one
    # before it, the cheapest; the shared state (256 tokens x 4 for its reuses, one request old)
    # stays at any tau >= 1 request
    assert set(m.pool.cached) == {key, busy.prefix_hash(448)}
    assert (m.num_snapshots, m.num_snapshots_skipped, m.num_evictions) == (8, 0, 6)
    m.restore("next", hashes(3), 0)  # the next request: now the state is older
    assert m.eviction.worth(key) < worth


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
