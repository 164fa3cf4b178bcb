"""`lifecycle.settle`: publish -> snapshot -> keep -> free, exactly what each step leaves cached."""

from __future__ import annotations

from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import EagleMode, HybridCoordinator
from cache_service.group_managers import GroupManagers
from cache_service.lifecycle import settle
from cache_service.specs import CacheLayout, parse_group_spec


class RecordingBackend:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        self.copies.append((group_id, src, dst))


def make_groups(num_blocks: int = 40, num_pages: int = 12) -> GroupManagers:
    layout = CacheLayout((parse_group_spec("full:16"), parse_group_spec("mamba:64")))
    return GroupManagers(HybridCoordinator(layout, EagleMode.OFF), [BlockPool(num_blocks, 0), BlockPool(num_pages, 1)],
                         RecordingBackend())


def admitted(groups: GroupManagers, n: int = 200, decoding: bool = False) -> RequestBlockHashes:
    hashes = RequestBlockHashes(16, list(range(n)))
    groups.admit("r", hashes, 0, n)
    if decoding:
        groups.grow("r", n + 1, decoding=True)
    return hashes


def test_publish_then_snapshot_the_working_state_and_keep_the_boundaries_asked_for():
    groups = make_groups()
    hashes = admitted(groups, decoding=True)
    full, mamba = groups.managers
    mamba.track_boundary("r", 64, mamba.working_page("r"))
    mamba.track_boundary("r", 128, mamba.working_page("r"))
    (_, boundary_128), = [(pos, page) for pos, page in mamba.boundary_states("r") if pos == 128]
    num_copies = len(groups.managers[1].backend.copies)
    stored = settle(groups, "r", hashes, [200, 200], working_state_at=192, keep={128, 100})
    assert stored == [12, 2]  # 12 full blocks of 200 tokens; the state at 192 and the boundary at 128
    copies = groups.managers[1].backend.copies[num_copies:]  # each snapshot copies its source page
    assert [(g, src) for g, src, _ in copies] == [(1, mamba.working_page("r")), (1, boundary_128)]
    assert set(mamba.pool.cached) == {hashes.prefix_hash(192), hashes.prefix_hash(128)}
    assert len(full.pool.cached) == 12 and mamba.holds("r")


def test_without_publish_or_a_position_nothing_is_cached_and_free_returns_every_page():
    groups = make_groups()
    hashes = admitted(groups)
    full, mamba = groups.managers
    num_free = (full.pool.num_free_blocks, mamba.pool.num_free_blocks)
    assert settle(groups, "r", hashes, [200, 200], publish=False, keep={64}) == [0, 0]
    assert not full.pool.cached and not mamba.pool.cached and mamba.holds("r")
    assert settle(groups, "r", hashes, [200, 200], publish=False, free=True) == [0, 0]
    assert not mamba.holds("r") and full.pool.num_free_blocks == num_free[0] + 13
    assert mamba.pool.num_free_blocks > num_free[1]


def test_an_unaligned_working_state_is_not_snapshotted_and_published_blocks_stay_cached_after_free():
    groups = make_groups()
    hashes = admitted(groups)
    full, mamba = groups.managers
    assert settle(groups, "r", hashes, [200, 200], working_state_at=100, free=True) == [12, 0]
    assert len(full.pool.cached) == 12 and not mamba.pool.cached and not mamba.holds("r")
