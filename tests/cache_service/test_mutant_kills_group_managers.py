"""The per-kind group managers behind one facade, exactly: which manager gets the Mamba options,
what admission, growth and publication take and return per group, the lossless draft block
copied rather than shared, and the pages a hit pins. Written to kill mutants `make mutants`
found surviving in cache_service/group_managers.py."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, HybridCoordinator, RequestBlockHashes
from cache_service.block_pool import BlockPool, PoolExhaustedError
from cache_service.group_managers import DraftAttentionManager, FullAttentionManager, GroupManagers
from cache_service.mamba_manager import MambaManager
from cache_service.simulate import make_tokens, simulate
from tests.cache_service.helpers import make_layout, make_scenario


class RecordingBackend:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        self.copies.append((group_id, src, dst))


def make_managers(pages=(40, 40, 12), eagle=EagleMode.LOSSLESS, **options):
    coord = HybridCoordinator(make_layout("full:16", "draft:16", "mamba:64"), eagle)
    backend = RecordingBackend()
    gm = GroupManagers(coord, [BlockPool(n, g) for g, n in enumerate(pages)], backend, mamba_options=options or None)
    return gm, backend


HASHES = RequestBlockHashes(16, make_tokens(160, 2, 1000))


def test_one_manager_per_group_and_only_mamba_gets_its_options():
    gm, _ = make_managers(num_verify_pages=2)
    full, draft, mamba = gm.managers
    assert (type(full), type(draft), type(mamba)) == (FullAttentionManager, DraftAttentionManager, MambaManager)
    assert gm.coordinator is full.coordinator and mamba.num_verify_pages == 2
    assert gm.of_kind("mamba") == [mamba] and gm.of_kind("draft") == [draft] and gm.of_kind("swa") == []


def test_admit_grow_publish_and_free_per_group():
    gm, _ = make_managers()
    full, draft, mamba = gm.managers
    assert gm.can_admit("r", HASHES, 0, 100)
    gm.admit("r", HASHES, 0, 100)
    assert all(m.holds("r") for m in gm.managers) and not full.holds("s")
    assert (len(full.req_to_blocks["r"]), len(draft.req_to_blocks["r"])) == (7, 7)
    assert full.num_blocks_needed("r", 100) == 0 and full.num_blocks_needed("r", 113) == 1
    assert gm.can_grow("r", 120, decoding=True) and not gm.can_grow("r", 16 * 60)
    gm.grow("r", 120, decoding=True)
    assert len(full.req_to_blocks["r"]) == 8 and len(mamba.slots["r"].boundary) == 2
    # publication is bounded by the computed tokens, then by the blocks the request holds
    assert gm.publish("r", HASHES, [40, 40, 40]) == [2, 2, 0]
    assert gm.publish("r", HASHES, [40, 40, 40]) == [0, 0, 0]
    assert gm.publish("r", HASHES, [96, 80, 96]) == [4, 3, 0]
    assert gm.publish("r", HASHES, [160, 160, 160]) == [2, 3, 0]  # 8 blocks held: up to 128
    assert gm.publish("r", HASHES, [160, 160, 160]) == [0, 0, 0]  # past the fast path, still nothing new
    keys = gm.cached_keys()
    assert keys[0] == keys[1] == {HASHES.prefix_hash(16 * (j + 1)) for j in range(8)} and keys[2] == set()
    gm.free("r")
    gm.free("nobody")  # freeing an unknown request is a no-op
    assert not any(m.holds("r") for m in gm.managers)
    assert "r" not in full.num_published and "r" not in draft.num_published


def test_publication_stops_at_the_hashed_tokens():
    gm, _ = make_managers()
    short = RequestBlockHashes(16, make_tokens(40, 2, 1000))  # 2 full hash blocks
    gm.admit("r", short, 0, 64)
    assert gm.publish("r", short, [64, 64, 64]) == [2, 2, 0]


def test_a_lossless_hit_copies_the_draft_block_at_its_end_and_pins_what_it_uses():
    gm, backend = make_managers()
    full, draft, mamba = gm.managers
    gm.admit("a", HASHES, 0, 100)
    gm.publish("a", HASHES, [96, 96, 96])
    assert mamba.snapshot(HASHES, mamba.working_page("a"), 64)
    a_draft = list(draft.req_to_blocks["a"])
    assert gm.pinned_by_hit(HASHES, 64) == [0, 0, 1]  # a still uses its attention blocks
    gm.free("a")
    # the hit of 64: 4 full blocks, 3 shared draft blocks + the one copied, the Mamba snapshot
    assert gm.pinned_by_hit(HASHES, 64) == [4, 4, 1]
    assert draft.num_shared_blocks(64) == 3 and draft.num_shared_blocks(0) == 0 and full.num_shared_blocks(64) == 4
    assert draft.copy_sources(HASHES, 64) == [a_draft[3]] and draft.copy_sources(HASHES, 0) == []
    del backend.copies[:]
    gm.admit("b", HASHES, 64, 100)
    b_draft = draft.req_to_blocks["b"]
    assert b_draft[:3] == a_draft[:3] and b_draft[3] is not a_draft[3] and len(b_draft) == 7
    assert (1, a_draft[3].block_id, b_draft[3].block_id) in backend.copies
    assert a_draft[3].ref_cnt == 0  # the copy source is released after the copy
    assert gm.pinned_by_hit(HASHES, 64) == [0, 1, 1]  # b uses the shared blocks; the copy sources are free
    off, _ = make_managers(eagle=EagleMode.OFF)
    assert off.managers[1].num_shared_blocks(64) == 4 and off.managers[1].copy_sources(HASHES, 64) == []


def test_admission_counts_spare_mamba_pages_and_pinned_pages():
    gm, _ = make_managers(pages=(40, 40, 2))  # one usable Mamba page
    assert gm.can_admit("r", HASHES, 0, 100)  # no spare page asked by default
    assert not gm.can_admit("r", HASHES, 0, 100, spare_pages=1)
    tight, _ = make_managers(pages=(12, 40, 12))  # 11 usable full-attention blocks
    tight.admit("a", HASHES, 0, 100)
    tight.publish("a", HASHES, [96, 96, 96])
    assert tight.managers[2].snapshot(HASHES, 1, 64)
    tight.free("a")  # 11 free full-attention blocks, 6 of them cached
    # a hit of 64 pins 4 cached free blocks and shares them: growing to 160 needs 6 more (10 <= 11)
    assert tight.can_admit("b", HASHES, 64, 160)
    assert not tight.can_admit("b", HASHES, 64, 16 * 12)  # 8 more: 4 pinned + 8 > 11


def make_swa(hashed_tokens: int = 160):
    coord = HybridCoordinator(make_layout("full:16", "sliding_window:16:40", "mamba:64"), EagleMode.OFF)
    gm = GroupManagers(coord, [BlockPool(20, g) for g in range(3)])
    return gm, RequestBlockHashes(16, make_tokens(hashed_tokens, 2, 1000))


def test_a_sliding_window_publishes_the_window_tail_of_each_checkpoint_and_drops_dead_blocks():
    gm, h = make_swa()
    swa = gm.managers[1]
    assert [swa._first_live(p) for p in (0, 39, 40, 54, 55, 100)] == [0, 0, 0, 0, 1, 3]
    gm.admit("r", h, 0, 100)
    table = list(swa.req_to_blocks["r"])
    # checkpoint 96: the tail [57, 96) lies in the blocks ending at 64, 80, 96
    assert gm.publish("r", h, [96, 96, 96], checkpoints=[96]) == [6, 3, 0]
    assert swa.publish("r", h, 96, [96]) == 0  # already published
    assert set(swa.pool.cached.values()) == set(table[3:6])
    null = swa.pool.null_block
    assert swa.req_to_blocks["r"] == [null] * 3 + table[3:]  # blocks wholly before the window of 96
    assert all(b.ref_cnt == 0 for b in table[:3])  # ... are given back
    assert swa.hit_blocks(h, 96) == [null] * 3 + table[3:6]


def test_a_sliding_window_never_publishes_past_the_hashed_tokens():
    gm, h = make_swa(hashed_tokens=100)  # 6 full hash blocks: 96 tokens
    swa = gm.managers[1]
    gm.admit("r", h, 0, 128)
    assert swa.publish("r", h, 128, [128]) == 1  # ends 96, 112, 128: only 96 is hashed
    assert set(swa.pool.cached) == {h.prefix_hash(96)}


def test_a_sliding_window_of_one_token_blocks():
    coord = HybridCoordinator(make_layout("sliding_window:1:4"), EagleMode.OFF)
    (swa,) = GroupManagers(coord, [BlockPool(20)]).managers
    assert [swa._first_live(p) for p in (0, 2, 3, 4, 10)] == [0, 0, 0, 1, 7]


def test_growth_checks_each_group_and_decodes_only_when_asked():
    gm, _ = make_managers(pages=(8, 40, 3))  # 7 full-attention blocks, 2 Mamba pages
    full, _, mamba = gm.managers
    gm.admit("r", HASHES, 0, 100)  # takes all 7 full blocks and one Mamba page
    assert full.pool.num_free_blocks == 0 and mamba.pool.num_free_blocks == 1
    assert gm.can_grow("r", 100)  # has all it needs: no decode pages unless decoding
    assert not gm.can_grow("r", 100, decoding=True)  # 2 decode pages, 1 free
    gm.grow("r", 100)
    assert mamba.slots["r"].boundary == [] and mamba.pool.num_free_blocks == 1


def test_a_simulated_request_needs_a_spare_mamba_page_or_stores_nothing():
    # 128 tokens: 8 of 9 full blocks fit, but the one usable Mamba page leaves no spare for a snapshot
    tight = simulate(make_scenario(["full:16", "mamba:64"], 128, num_blocks_per_group=(10, 2)), explain=True)
    assert tight.cold.explanation[-1] == "pools too small to hold the whole prompt: nothing stored"
    assert [pool.num_cached_blocks for pool in tight.cache.pools] == [0, 0]
    roomy = simulate(make_scenario(["full:16", "mamba:64"], 128, num_blocks_per_group=(10, 3)), explain=True)
    assert roomy.cold.explanation[-1].startswith("reconciliation:") and roomy.resend.hit.hit_tokens == 0
    # the cold run cached all 8 blocks; its one snapshot page kept 128, not the replay boundary
    # 64, so the resend misses and recomputes in fresh pages, as the engine does: the chunk
    # [0, 64) evicts the cold copies of blocks 8..6 (LRU: a request's last blocks go first) while
    # its own copies of blocks 1..4 stay private (first copy wins); the chunk [64, 128) evicts
    # blocks 5..2 and publishes 5..8: blocks 1 and 5..8 stay cached
    assert roomy.cache.pools[0].num_cached_blocks == 5


def test_allocation_takes_empty_blocks_first_then_the_least_recently_freed_cached_one():
    """A freed block holding no hash goes to the head of the free queue (reusing it costs nothing),
    a cached one to the tail (LRU). A pool that appended empty blocks at the tail, or took from the
    tail, would evict a cached block while an empty one waits (the first two asserts fail)."""
    pool = BlockPool(5)
    b1, b2, b3, _ = pool.allocate(4)
    k1, k3 = HASHES.prefix_hash(16), HASHES.prefix_hash(32)
    pool.cache_block(b1, k1)
    pool.cache_block(b3, k3)
    pool.free([b1])
    pool.free([b2])  # empty: ahead of b1, though freed after it
    pool.free([b3])
    assert pool.allocate(1) == [b2] and pool.get_cached(k1) is b1 and pool.get_cached(k3) is b3
    assert pool.allocate(1) == [b1] and pool.get_cached(k1) is None  # LRU among cached: evicted, not skipped
    assert pool.get_cached(k3) is b3
    pool = BlockPool(4)
    c1, c3, _ = pool.allocate(3)
    pool.cache_block(c1, k1)
    pool.cache_block(c3, k3)
    pool.free([c1])
    pool.free([c3])  # LRU order: c1, c3
    assert pool.evict(k3) and pool.allocate(1) == [c3] and pool.get_cached(k1) is c1  # evicted: empty, first


def test_publishing_ahead_of_growth_marks_only_the_blocks_held():
    # kills AttentionManager.publish__mutmut_9: without the `len(blocks)` bound, blocks 5..10
    # would count as published though only 4 are held, and the later ones would never be cached
    gm, _ = make_managers()
    full = gm.managers[0]
    gm.admit("r", HASHES, 0, 64)  # 4 blocks held
    assert full.publish("r", HASHES, 160) == 4
    gm.grow("r", 160)
    assert full.publish("r", HASHES, 160) == 6
    assert set(full.pool.cached) == {HASHES.prefix_hash(16 * (j + 1)) for j in range(10)}


def test_a_hit_beyond_the_hashed_prefix_is_a_clear_error():
    # kills AttentionManager._block_keys__mutmut_12 (TypeError) and _13 (asks a 0.75-token prefix):
    # the error names the prefix asked for
    full = make_managers()[0].managers[0]
    with pytest.raises(ValueError, match="no block hash for a 192-token prefix"):
        full.hit_blocks(HASHES, 192)  # 160 tokens hashed


def cached_hit_of_64(eagle=EagleMode.LOSSLESS, pages=(40, 40, 12)):
    """Managers holding a free cached hit of 64: 4 full, 4 draft blocks and a Mamba snapshot."""
    gm, backend = make_managers(pages, eagle)
    gm.admit("a", HASHES, 0, 64)
    gm.publish("a", HASHES, [64, 64, 64])
    assert gm.managers[2].snapshot(HASHES, gm.managers[2].working_page("a"), 64)
    gm.free("a")
    return gm


def test_a_hit_is_held_only_while_every_page_it_restores_is_cached():
    # kills holds_hit__mutmut_3 and _8 (a cached hit reads as missing) and _10 (the draft
    # block copied at the hit's end and the Mamba snapshot are not checked)
    assert cached_hit_of_64().holds_hit(HASHES, 64)
    for group in range(3):  # full: a shared block; draft: the copied block; Mamba: the snapshot
        gm = cached_hit_of_64()
        assert gm.managers[group].pool.evict(HASHES.prefix_hash(64))
        assert not gm.holds_hit(HASHES, 64)


def test_admission_counts_the_snapshot_a_hit_copies_from():
    # kills can_admit__mutmut_11: the Mamba page a hit copies from is pinned while the working
    # page is taken, so it cannot be that page; can_admit says so exactly when admit would fail
    gm = cached_hit_of_64(pages=(40, 40, 3))  # 2 usable Mamba pages: the snapshot and one more
    gm.admit("x", HASHES, 0, 16)  # holds the uncached one as its working page
    assert not gm.can_admit("b", HASHES, 64, 100)
    with pytest.raises(PoolExhaustedError):
        gm.admit("b", HASHES, 64, 100)
    roomy = cached_hit_of_64(pages=(40, 40, 4))
    roomy.admit("x", HASHES, 0, 16)
    assert roomy.can_admit("b", HASHES, 64, 100)
    roomy.admit("b", HASHES, 64, 100)


def test_admitting_a_prompt_cached_whole_needs_no_fresh_attention_block():
    # kills can_admit__mutmut_35: a hit covering all positions (a transfer received over a
    # prefix already cached asks this) pins the free cached blocks and takes no new one, so a
    # pool whose free blocks are exactly the hit's admits it
    gm = cached_hit_of_64(eagle=EagleMode.OFF, pages=(5, 5, 3))  # the 4 usable blocks: the hit's
    assert gm.can_admit("b", HASHES, 64, 64)
    gm.admit("b", HASHES, 64, 64)
    assert gm.managers[0].req_to_blocks["b"] == [gm.managers[0].pool.get_cached(HASHES.prefix_hash(e))
                                                 for e in (16, 32, 48, 64)]
    assert not gm.can_admit("c", HASHES, 0, 16)  # and nothing is left


def test_num_covered_positions_is_the_least_attention_cover_unless_mamba_needs_a_page():
    """What the engine's growth fast path trusts: positions reachable without taking any page."""
    gm, _ = make_managers()
    full, draft, mamba = gm.managers
    gm.admit("r", HASHES, 0, 100)  # 7 blocks of 16 in each attention group
    assert gm.num_covered_positions("r") == 7 * 16
    assert mamba.num_blocks_needed("r", 0, True) > 0 and gm.num_covered_positions("r", decoding=True) == 0
    gm.grow("r", 120, decoding=True)  # 8 blocks, and the Mamba boundary pages a decode needs
    assert gm.num_covered_positions("r", decoding=True) == 8 * 16
    draft.pool.free(reversed(draft.req_to_blocks["r"][7:]))
    del draft.req_to_blocks["r"][7:]  # the draft group one block short: the least cover counts
    assert gm.num_covered_positions("r", decoding=True) == 7 * 16
