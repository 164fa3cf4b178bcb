"""The Mamba manager's pages, exactly: what a request needs and holds (working, boundary, verify
pages), which page every state copy reads and writes, the snapshot counters and the checkpoint
values of the module docstring's formula. Written to kill mutants `make mutants` found surviving
in cache_service/mamba_manager.py."""

from __future__ import annotations

import pytest

from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool, PoolExhaustedError
from cache_service.coordinator import HybridCoordinator
from cache_service.eviction import make_eviction
from cache_service.eviction_policy import StateEntry as _Entry
from cache_service.mamba_manager import MambaManager
from cache_service.simulate import make_tokens
from cache_service.specs import CacheLayout, FullAttentionSpec, MambaSpec
from cache_service.value_eviction import ValueEviction

LAYOUT = CacheLayout((FullAttentionSpec(16), MambaSpec(64)))


class RecordingBackend:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        self.copies.append((group_id, src, dst))


def make_manager(num_pages: int = 12, **kw) -> MambaManager:
    return MambaManager(1, LAYOUT.groups[1], BlockPool(num_pages, 1), HybridCoordinator(LAYOUT),
                        RecordingBackend(), **kw)


def hashes(seed: int = 0, n: int = 512) -> RequestBlockHashes:
    return RequestBlockHashes(16, make_tokens(n, seed, 1000))


def test_defaults_and_fresh_counters():
    m = make_manager()
    assert (m.num_verify_pages, m.num_decode_pages, m.page_size_bytes) == (0, 2, 1)
    assert (m.eviction.now, m.num_snapshots, m.num_snapshots_skipped, m.num_evictions) == (0, 0, 0, 0)
    assert isinstance(m.eviction, ValueEviction) and m.eviction.page_bytes == 1
    assert make_manager(page_size_bytes=0).page_size_bytes == 1  # at least one byte per page
    assert make_manager(page_size_bytes=3).page_size_bytes == 3
    assert make_manager(num_verify_pages=3).num_decode_pages == 5


def test_pages_a_request_needs_and_holds_while_prefilling_then_decoding():
    m = make_manager(num_verify_pages=2)
    h = hashes()
    assert m.num_blocks_needed("r", 128) == 1  # a working page
    assert m.num_blocks_needed("r", 128, decoding=True) == 1 + 4  # and 2 boundary + 2 verify pages
    assert not m.holds("r") and m.boundary_states("r") == []
    m.restore("r", h, 0)
    assert m.holds("r") and m.boundary_states("r") == []
    assert m.num_blocks_needed("r", 256) == 0
    assert m.num_blocks_needed("other", 256) == 1
    assert m.num_blocks_needed("r", 256, decoding=True) == 4
    m.grow("r", 256)  # prefilling: nothing more
    assert (m.slots["r"].boundary, m.slots["r"].verify) == ([], [])
    m.grow("r", 257, decoding=True)
    slots = m.slots["r"]
    assert len(slots.boundary) == 2 and len(slots.verify) == 2
    ids = {slots.working.block_id, *(p.block_id for p in slots.boundary), *(p.block_id for p in slots.verify)}
    assert len(ids) == 5 and m.pool.num_free_blocks == 12 - 1 - 5
    assert m.num_blocks_needed("r", 258, decoding=True) == 0
    m.grow("r", 258, decoding=True)  # already has them: nothing more
    assert m.pool.num_free_blocks == 6
    assert m.verify_pages("r", 2) == tuple(p.block_id for p in slots.verify)
    assert m.verify_pages("r", 1) == (slots.verify[0].block_id,)
    assert m.publish("r", h, 256) == 0
    m.free("r")
    m.free("r")  # a second free (or of an unknown request) is a no-op
    assert not m.holds("r") and m.pool.num_free_blocks == 11


def test_restore_copies_the_checkpoint_into_the_working_page_and_counts_a_reuse():
    m = make_manager()
    h = hashes()
    assert m.snapshot(h, 7, 128)
    (page,) = m.pool.cached.values()
    assert m.backend.copies == [(1, 7, page.block_id)]
    m.restore("r", h, 128)
    working = m.working_page("r")
    assert working != page.block_id
    assert m.backend.copies[-1] == (1, page.block_id, working)
    st = m.eviction.known()[h.prefix_hash(128)]
    assert (st.position, st.num_reuses, st.last_use, m.eviction.now) == (128, 1, 1, 1)  # a request: a tick
    m.restore("s", h, 128)
    assert (st.num_reuses, st.last_use, m.eviction.now) == (2, 2, 2)
    m.restore("t", h, 0)  # a cold start copies nothing, but is a request
    assert len(m.backend.copies) == 3 and m.eviction.now == 3 and st.last_use == 2


def test_boundaries_rotate_through_the_two_boundary_pages_and_rollback_reads_a_verify_page():
    m = make_manager(num_verify_pages=3)
    m.restore("r", hashes(), 0)
    m.grow("r", 1, decoding=True)
    slots = m.slots["r"]
    b0, b1 = (p.block_id for p in slots.boundary)
    work = slots.working.block_id
    m.track_boundary("r", 64, 90)
    assert m.boundary_states("r") == [(64, b0)] and m.backend.copies[-1] == (1, 90, b0)
    m.track_boundary("r", 128, 91)
    assert m.boundary_states("r") == [(64, b0), (128, b1)] and m.backend.copies[-1] == (1, 91, b1)
    m.track_boundary("r", 192, 92)  # replaces the oldest (64) and keeps oldest first
    assert m.boundary_states("r") == [(128, b1), (192, b0)] and m.backend.copies[-1] == (1, 92, b0)
    m.track_boundary("r", 256, 93)
    assert m.boundary_states("r") == [(192, b0), (256, b1)] and m.backend.copies[-1] == (1, 93, b1)
    m.rollback("r", 1)
    assert m.backend.copies[-1] == (1, slots.verify[1].block_id, work)
    m.rollback("r", 0)
    assert m.backend.copies[-1] == (1, slots.verify[0].block_id, work)


def test_snapshot_positions_and_counters():
    m = make_manager()
    h = hashes()
    assert not m.snapshot(h, 5, 0) and not m.snapshot(h, 5, 65) and not m.snapshot(h, 5, -64)
    assert m.num_snapshots == 0 and m.backend.copies == [] and m.eviction.known() == {}
    assert m.snapshot(h, 5, 64) and m.snapshot(h, 6, 128)
    assert (m.eviction.now, m.num_snapshots, m.num_snapshots_skipped) == (0, 2, 0)  # snapshots: no tick
    entries = m.eviction.known()
    assert entries == {h.prefix_hash(64): _Entry(64, 64.0, 0, 0), h.prefix_hash(128): _Entry(128, 128.0, 0, 0)}
    # (the state at 64 has served no hit: the one at 128 is worth its whole prefix)
    m.restore("r", hashes(9), 0)
    assert not m.snapshot(h, 7, 64)  # already cached: not taken again, but its use is recorded
    assert (entries[h.prefix_hash(64)].last_use, entries[h.prefix_hash(128)].last_use) == (1, 0)
    assert m.num_snapshots == 2
    assert len(m.backend.copies) == 2
    one = MambaManager(1, MambaSpec(1), BlockPool(4, 1), HybridCoordinator(CacheLayout((MambaSpec(1),))),
                       RecordingBackend())
    assert one.snapshot(RequestBlockHashes(1, [3, 1, 4]), 0, 1)  # block size 1: position 1 is a checkpoint


def test_a_snapshot_without_room_is_skipped_and_counted():
    m = make_manager(4)  # 3 usable pages
    h = hashes()
    m.restore("a", h, 0)
    m.restore("b", h, 0)
    m.restore("c", h, 0)
    assert not m.snapshot(h, 1, 64) and not m.snapshot(h, 1, 128)
    assert (m.num_snapshots_skipped, m.num_snapshots, m.eviction.now) == (2, 0, 3)
    with pytest.raises(PoolExhaustedError):  # no page, no checkpoint to evict
        m.restore("d", h, 0)


def test_a_zero_budget_keeps_no_checkpoint():
    m = make_manager(max_retained_pages=0)
    assert not m.snapshot(hashes(), 1, 64)
    assert (m.num_snapshots_skipped, m.num_retained, m.num_evictions) == (1, 0, 0)


def test_the_budget_skips_a_snapshot_worth_exactly_the_cheapest_and_evicts_a_cheaper_one():
    m = make_manager(max_retained_pages=1)
    a, b = hashes(1), hashes(2)
    assert m.snapshot(a, 1, 128)  # worth 128 now
    assert not m.snapshot(b, 1, 128)  # the same request, the same worth: the retained one stays
    assert m.num_snapshots_skipped == 1 and set(m.pool.cached) == {a.prefix_hash(128)}
    m.restore("r", hashes(9), 0)  # one request later a is worth 128 * e^(-1/16) < 128: a goes
    assert m.snapshot(b, 1, 128)
    assert set(m.pool.cached) == {b.prefix_hash(128)} and m.num_evictions == 1
    assert set(m.eviction.known()) == {b.prefix_hash(128)}
    m.restore("s", b, 128)  # b reused: worth 128 * 2, beyond a fresh 192 in the same request
    assert m.eviction.worth(b.prefix_hash(128)) == 256.0
    assert not m.snapshot(a, 1, 192)
    assert (m.num_snapshots_skipped, m.num_snapshots) == (2, 2)
    assert m.snapshot(a, 1, 320)  # 320 > 256: taken
    assert set(m.pool.cached) == {a.prefix_hash(320)}


def test_the_value_formula():
    m = make_manager(page_size_bytes=4)
    e = m.eviction
    h = hashes()
    assert m.snapshot(h, 1, 128)
    key = h.prefix_hash(128)
    assert e.worth(key) == 128 / 4
    for i in range(64):  # one tau (64 requests before any reuse is seen) later: / e
        m.restore(f"q{i}", hashes(50 + i), 0)
        m.free(f"q{i}")
    assert e.worth(key) == pytest.approx(128 / 4 / 2.718281828459045)
    m.restore("r", h, 128)  # a reuse 65 requests after its last use: tau = 2 x the mean distance
    assert (e.tau, e.worth(key)) == (130.0, 128 / 4 * 2)
    assert m.snapshot(h, 1, 256)  # gain over the retained state at 128: 128 tokens, not 256
    assert e.known()[h.prefix_hash(256)].gain == 128 / 4


def test_a_page_registered_without_a_snapshot_counts_as_fresh_and_never_reused():
    m = make_manager()
    h = hashes()
    m.restore("q", hashes(9), 0)
    (page,) = m.pool.allocate(1)
    m.pool.cache_block(page, h.prefix_hash(64))  # a transfer registered it
    m.pool.free([page])
    assert m.snapshot(h, 1, 256)  # the policy adopts it on its next decision
    assert m.eviction.known()[h.prefix_hash(64)] == _Entry(0, 0.0, 0, 1)
    assert m.eviction.victim(m._evictable) == h.prefix_hash(64)


def test_states_evicted_behind_the_managers_back_are_dropped_from_the_policy():
    m = make_manager(4)
    for seed in range(8):
        h = hashes(seed)
        assert m.snapshot(h, 1, 64)
        m.pool.evict(h.prefix_hash(64))  # evicted by someone else: the policy still knows it
    assert len(m.eviction.known()) == 1
    last = hashes(8)
    assert m.snapshot(last, 1, 64)
    assert m.eviction.known() == {last.prefix_hash(64): _Entry(64, 64.0, 0, 0)}


def test_a_transferred_checkpoint_learns_its_position_when_reused_or_snapshotted_again():
    m = make_manager()
    h = hashes()
    for position in (64, 128):  # registered by a transfer: no position yet
        (page,) = m.pool.allocate(1)
        m.pool.cache_block(page, h.prefix_hash(position))
        m.pool.free([page])
    m.restore("r", h, 64)
    assert m.eviction.known()[h.prefix_hash(64)] == _Entry(64, 64.0, 1, 1)
    assert not m.snapshot(h, 1, 128)
    assert m.eviction.known()[h.prefix_hash(128)] == _Entry(128, 128.0, 0, 1)


def test_skips_and_evictions_are_counted_one_by_one():
    m = make_manager(max_retained_pages=0)
    assert not m.snapshot(hashes(1), 1, 64) and not m.snapshot(hashes(2), 1, 64)
    assert m.num_snapshots_skipped == 2
    b = make_manager(max_retained_pages=1)
    for seed in range(3):  # each new one, a request later, is worth more than the retained one
        b.restore(f"r{seed}", hashes(9), 0)
        b.free(f"r{seed}")
        assert b.snapshot(hashes(seed), 1, 64)
    assert (b.num_evictions, b.num_snapshots, b.num_retained) == (2, 3, 1)


def test_a_page_in_use_first_in_the_pool_does_not_stop_the_search_for_the_cheapest():
    # the checkpoint a restore copies from is pinned while the working page is taken; the others
    # are still ranked by value (64 goes), not left to the pool's LRU (which would take 128)
    m = make_manager(4)  # 3 pages
    h = hashes()
    for position in (192, 128, 64):  # cached in this order; LRU order of the free pages too
        assert m.snapshot(h, 1, position)
    m.restore("r", h, 192)
    assert set(m.pool.cached) == {h.prefix_hash(192), h.prefix_hash(128)} and m.num_evictions == 1


def test_a_transferred_page_is_ranked_before_anyone_used_it():
    # a page a transfer registered counts as a state of no known value: the first to go over budget
    m = make_manager(max_retained_pages=2)
    a, b = hashes(1), hashes(2)
    assert m.snapshot(a, 1, 128)
    (page,) = m.pool.allocate(1)
    m.pool.cache_block(page, a.prefix_hash(64))  # a transfer registered it: no stats
    m.pool.free([page])
    assert m.snapshot(b, 1, 192)
    assert set(m.pool.cached) == {a.prefix_hash(128), b.prefix_hash(192)} and m.num_evictions == 1


# ---- the budget's admission path and the adoption before evicting (mutation testing, 6 Dec) ------
def test_a_snapshot_already_cached_under_marconi_records_a_use_and_no_reuse():
    m = make_manager(eviction=make_eviction("marconi"))
    h = hashes()
    assert m.snapshot(h, 1, 64) and not m.snapshot(h, 1, 64)
    assert m.eviction.known()[h.prefix_hash(64)].num_reuses == 0


def test_a_grid_snapshot_does_not_displace_a_boundary_state_that_a_boundary_one_would():
    m = make_manager(max_retained_pages=1)
    assert m.snapshot(hashes(1), 1, 64)
    assert not m.snapshot(hashes(2), 1, 256, periodic=True)
    assert m.snapshot(hashes(2), 1, 256)


def test_when_the_victim_is_the_parent_the_gain_counts_from_the_state_below_it():
    m = make_manager(max_retained_pages=1)
    h = hashes()
    assert m.snapshot(h, 1, 64)
    m.restore("r", h, 64)  # reused: worth 64 x 2
    assert m.snapshot(h, 1, 192)  # evicting its parent at 64: worth 192 from 0, more than 128
    assert set(m.pool.cached) == {h.prefix_hash(192)}


def test_when_the_victim_is_not_the_parent_the_gain_counts_from_the_parent():
    m = make_manager(max_retained_pages=2)
    h = hashes()
    assert m.snapshot(h, 1, 64)
    m.restore("r", h, 64)  # reused: the parent of h's later states
    assert m.snapshot(hashes(2), 1, 64)  # worth 64, the cheapest
    assert not m.snapshot(h, 1, 128)  # worth 128 - 64 = 64: no more than the cheapest


def test_the_parent_can_sit_at_position_1_with_a_block_size_of_1():
    one = MambaManager(1, MambaSpec(1), BlockPool(8, 1), HybridCoordinator(CacheLayout((MambaSpec(1),))),
                       RecordingBackend())
    h = RequestBlockHashes(1, [3, 1, 4, 1, 5])
    assert one.snapshot(h, 0, 1)
    one.restore("r", h, 1)
    assert one.snapshot(h, 0, 3)
    assert one.eviction.known()[h.prefix_hash(3)].gain == one.eviction.gain(3, 1) != one.eviction.gain(3, 0)


def test_a_page_cached_behind_the_managers_back_is_adopted_before_one_page_is_evicted():
    m = make_manager(4)  # 3 usable pages
    (page,) = m.pool.allocate(1)
    m.pool.cache_block(page, hashes(1).prefix_hash(64))  # a transfer
    m.pool.free([page])
    m.restore("a", hashes(5), 0)
    m.restore("b", hashes(6), 0)
    m.restore("c", hashes(7), 0)  # one page needed, the transferred one evicted through the policy
    assert m.num_evictions == 1 and m.eviction.known() == {}


def test_a_parent_above_the_first_block_that_is_the_victim_is_looked_below():
    m = make_manager(max_retained_pages=1)
    h = hashes()
    assert m.snapshot(h, 1, 128)
    m.restore("r", h, 128)  # reused: worth 128 x 2
    assert m.snapshot(h, 1, 320)  # its parent goes: worth 320 from 0 (nothing retained at 64)
    assert set(m.pool.cached) == {h.prefix_hash(320)}


def test_a_transferred_page_joins_the_policy_only_when_a_page_must_be_evicted():
    m = make_manager(4)  # 3 usable pages
    (page,) = m.pool.allocate(1)
    m.pool.cache_block(page, hashes(1).prefix_hash(64))
    m.pool.free([page])
    m.restore("a", hashes(5), 0)
    m.restore("b", hashes(6), 0)  # takes the last empty page: nothing to evict, the policy untouched
    assert m.eviction.known() == {} and m.num_evictions == 0
