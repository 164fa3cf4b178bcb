"""The host tier in the cache core: demotion on device eviction, promotion on a hit, pins, the
host policy, KV support while a state is on the host, and the slot bookkeeping."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.eviction import make_eviction
from cache_service.global_index import GlobalIndex
from cache_service.host_tier import HostTier
from cache_service.router import Router, RouterConfig
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import dev_host_cold, make_layout

KEYS = RequestBlockHashes(16, make_tokens(160, 0, 50)).hashes


class Recorder:
    def __init__(self):
        self.saves, self.loads = [], []

    def save_page(self, group_id, block_id, slot):
        self.saves.append((group_id, block_id, slot))

    def load_page(self, group_id, slot, block_id):
        self.loads.append((group_id, slot, block_id))


def test_demote_copies_once_and_drops_least_recently_used_first():
    backend = Recorder()
    host = HostTier(3, 2, backend)
    assert host.demote(KEYS[0], 5) and host.demote(KEYS[1], 6)
    assert backend.saves == [(3, 5, 0), (3, 6, 1)]
    assert host.demote(KEYS[0], 7) and len(backend.saves) == 2  # held already: no copy, now most recent
    assert host.demote(KEYS[2], 8)  # full: KEYS[1] (least recently used) goes, its slot is reused
    assert KEYS[1] not in host and backend.saves[-1] == (3, 8, 1) and host.num_dropped == 1
    host.promote(KEYS[0], 9)
    assert backend.loads == [(3, 0, 9)] and host.num_promoted == 1 and KEYS[0] in host  # inclusive
    host.check_integrity()


def test_pinned_pages_are_never_dropped_and_a_full_pinned_host_refuses():
    host = HostTier(0, 2)
    host.demote(KEYS[0], 1)
    host.demote(KEYS[1], 2)
    host.pin([KEYS[0], KEYS[1]])
    assert not host.demote(KEYS[2], 3) and host.num_refused == 1 and len(host) == 2
    host.unpin()
    assert host.demote(KEYS[2], 3) and KEYS[0] not in host


def test_host_blocks_no_state_makes_usable_go_first():
    """An attention block whose every supporting state is gone (kv_support says so through
    `reconsider`) leaves the host before older blocks a hit can still use (catches: plain LRU on
    the host, a reconsider that is not told)."""
    usable = {KEYS[0], KEYS[1], KEYS[2], KEYS[3]}
    host = HostTier(0, 3)
    host.keeps = usable.__contains__
    for i in range(3):
        host.demote(KEYS[i], i + 1)
    usable.discard(KEYS[1])
    host.reconsider(KEYS[1])
    host.check_integrity()
    assert host.demote(KEYS[3], 9) and KEYS[1] not in host and KEYS[0] in host
    assert host.demote(KEYS[4], 11) and KEYS[0] not in host  # no spare block: least recently used
    assert host.demote(KEYS[5], 12) and KEYS[4] not in host  # KEYS[4] no state makes usable: spare
    host.check_integrity()


def test_the_mamba_host_policy_refuses_a_state_worth_less_than_every_held_one():
    host = HostTier(1, 1, policy=make_eviction("value", 1))
    positions = {KEYS[0]: 1024, KEYS[1]: 64}
    host.position_of = positions.get
    assert host.demote(KEYS[0], 1)
    assert not host.demote(KEYS[1], 2) and KEYS[0] in host  # a 64-token state is worth less than 1024
    positions[KEYS[2]] = 4096
    assert host.demote(KEYS[2], 3) and KEYS[0] not in host


def test_a_host_tier_needs_a_page():
    with pytest.raises(ValueError, match="at least 1 page, got 0"):
        HostTier(0, 0)


def test_a_pool_demotes_kept_blocks_it_evicts_and_drops_spare_ones():
    pool = BlockPool(3)
    pool.host = HostTier(0, 4)
    pool.keeps = lambda key: key != KEYS[1]
    a, b = pool.allocate(2)
    pool.cache_block(a, KEYS[0])
    pool.cache_block(b, KEYS[1])
    pool.free([a, b])
    assert pool.num_spare_blocks == 1
    pool.allocate(2)  # evicts both: the spare one first (dropped), then the kept one (demoted)
    assert KEYS[0] in pool.host and KEYS[1] not in pool.host
    pool.check_integrity()


def cache_with(host_pages, kv_blocks=10, state_pages=20, eviction=None, retained=None):
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
    return LocalPrefixCache(coord, [kv_blocks, state_pages], eviction=eviction, max_retained_pages=retained,
                            host_pages=host_pages)


def test_promotion_pins_the_hits_host_pages_while_its_own_pages_demote_others():
    """A's 8 KV blocks fill the host; promoting them takes 8 device blocks, each evicting one of B's
    (demoted, into a host full of A's). Without pins the host would drop A's pages before they are
    promoted (a KeyError mid-admission); with them, B's demotions are refused and A hits whole."""
    cache = cache_with([8, 8])
    a = RequestBlockHashes(16, make_tokens(129, 1, 50))
    b = RequestBlockHashes(16, make_tokens(144, 2, 50))
    cache.store_prefix(a, 129, (128,))
    cache.store_prefix(b, 144, (128,))  # 9 blocks: A's 8 go to the host
    host = cache.pools[0].host
    assert len(host) == 8 and all(k in host for k in a.hashes[:8]) and not cache.pools[0].cached.keys() & a.hashes
    assert cache.lookup(a, 129).hit_tokens == 128
    result = cache.store_prefix(a, 129, (128,), hit_tokens=128)
    assert result.admitted and result.num_promoted_pages == (8, 0)
    assert host.num_refused >= 7  # B's demotions while A's pages were pinned
    cache.check_integrity()
    assert cache_with([]).lookup(a, 129).hit_tokens == 0  # (sanity: a fresh cache holds nothing)


def test_without_a_host_tier_the_same_traffic_loses_the_hit():
    cache = cache_with([])
    a = RequestBlockHashes(16, make_tokens(129, 1, 50))
    cache.store_prefix(a, 129, (128,))
    cache.store_prefix(RequestBlockHashes(16, make_tokens(144, 2, 50)), 144, (128,))
    assert cache.lookup(a, 129).hit_tokens == 0


def test_a_state_on_the_host_keeps_its_kv_usable_until_the_host_drops_it():
    """KV support counts states on either tier: A's state demoted (budget 1) keeps A's blocks kept;
    dropped from the host as well, they become spare (what no hit can use goes first)."""
    for host_pages, kept in (([0, 4], True), ([], False)):
        cache = cache_with(host_pages, kv_blocks=40, retained=1)
        a = RequestBlockHashes(16, make_tokens(129, 1, 50))
        cache.store_prefix(a, 129, (128,))
        cache.store_prefix(RequestBlockHashes(16, make_tokens(129, 3, 50)), 129, (128,))
        state = a.prefix_hash(128)
        assert state not in cache.pools[1].cached
        assert cache.groups.support.keeps(a.hashes[7]) is kept
        assert cache.lookup(a, 129).hit_tokens == (128 if kept else 0)
        if kept:
            cache.pools[1].host.drop(state)
            assert not cache.groups.support.keeps(a.hashes[7]) and cache.pools[0].num_spare_blocks >= 8
        cache.check_integrity()


def test_reset_prefix_cache_forgets_the_host_too():
    cache = cache_with([8, 8])
    a = RequestBlockHashes(16, make_tokens(129, 1, 50))
    cache.store_prefix(a, 129, (128,))
    cache.store_prefix(RequestBlockHashes(16, make_tokens(144, 2, 50)), 144, (128,))
    assert all(pool.reset_prefix_cache() for pool in cache.pools)
    assert len(cache.pools[0].host) == 0 and cache.lookup(a, 129).hit_tokens == 0
    cache.check_integrity()


def index_of(cache: LocalPrefixCache, replica: str = "r") -> GlobalIndex:
    index = GlobalIndex(len(cache.pools))
    index.add_replica(replica)
    assert not index.apply(replica, cache.events.drain()).needs_resync
    return index


def tier_keys(index: GlobalIndex, group: int, host: bool, replica: str = "r") -> set:
    bit = 1 << index.replicas[replica].bit
    return {k for k, v in (index.host_holders if host else index.holders)[group].items() if v & bit}


def test_the_index_keeps_each_page_on_the_tier_the_replica_holds_it():
    """Events carry the tier: after traffic that demotes, promotes and drops, the index's device and
    host entries of the replica are exactly its pools' and host tiers' keys (catches: a demotion
    announced as a device store, a promotion or a host drop not announced, CLEARED leaving host
    entries), and its both-tier view serves the hit the worker itself finds."""
    cache = cache_with([20, 3], kv_blocks=12, state_pages=6, retained=2)
    order = [0, 1, 2, 0, 3, 1, 4, 5, 0, 2, 6, 7, 8, 1]  # revisits after other traffic: promotions
    lengths = [129 + 16 * (i % 3) for i in order]
    prompts = [RequestBlockHashes(16, make_tokens(n, i, 50)) for i, n in zip(order, lengths)]
    index = GlobalIndex(2)
    index.add_replica("r")
    for hashes, n in zip(prompts, lengths):
        hit = cache.lookup(hashes, n).hit_tokens
        cache.store_prefix(hashes, n, (128,), hit_tokens=hit)
        assert not index.apply("r", cache.events.drain()).needs_resync
        for g, pool in enumerate(cache.pools):
            assert tier_keys(index, g, host=False) == set(pool.cached)
            assert tier_keys(index, g, host=True) == set(pool.host.slots)
        both = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
        assert both.find_longest_hit(hashes.hashes, n, index.view("r", tiers=True)).hit_tokens == \
            cache.lookup(hashes, n).hit_tokens
    assert sum(p.host.num_demoted for p in cache.pools) and sum(p.host.num_promoted for p in cache.pools)
    assert sum(p.host.num_dropped for p in cache.pools)
    assert all(pool.reset_prefix_cache() for pool in cache.pools)
    index.apply("r", cache.events.drain())
    assert not any(index.holders) and not any(index.host_holders)


def test_a_resync_carries_the_host_tier():
    cache = cache_with([8, 8])
    a = RequestBlockHashes(16, make_tokens(129, 1, 50))
    cache.store_prefix(a, 129, (128,))
    cache.store_prefix(RequestBlockHashes(16, make_tokens(144, 2, 50)), 144, (128,))
    index = GlobalIndex(2)
    index.resync("r", [list(p.cached) for p in cache.pools], cache.events.next_seq,
                 [list(p.host.slots) for p in cache.pools])
    assert tier_keys(index, 0, host=True) == set(a.hashes[:8]) and tier_keys(index, 0, host=False)
    assert index.replicas["r"].num_host_entries == [8, 0]


def test_the_router_prices_a_host_hit_between_a_device_hit_and_recompute():
    """Three replicas: `dev` holds a 256-token prefix on its device, `host` on its host tier only,
    `cold` nothing. Equal load: `dev` wins; `dev` busier by more than the copy costs: `host` wins
    (its hit is counted, the copy priced); `host` busier by more than recompute saves: `cold`."""
    index, coord, hashes = dev_host_cold()
    router = Router(index, coord, "hybrid", RouterConfig(host_cost_per_token=0.02))
    scored = router.hits(hashes.hashes, 300, None)
    assert scored.hit_tokens == {"dev": 256, "host": 256} and scored.host_tokens == {"host": 256}
    assert router.route(hashes.hashes, 300, {"dev": 0, "host": 0, "cold": 0}).replica_id == "dev"
    copy = 256 * 0.02  # 5.12 queued tokens' worth
    picked = router.route(hashes.hashes, 300, {"dev": 6, "host": 0, "cold": 0})
    assert picked.replica_id == "host" and picked.expected_hit_tokens == 256
    assert router.route(hashes.hashes, 300, {"dev": 5, "host": 0, "cold": 0}).replica_id == "dev"  # 5 < copy
    assert router.route(hashes.hashes, 300, {"dev": 300, "host": 300, "cold": 0}).replica_id == "cold"
    assert copy == pytest.approx(5.12)
    with pytest.raises(ValueError, match="host_cost_per_token must be in"):
        RouterConfig(host_cost_per_token=1.0)
