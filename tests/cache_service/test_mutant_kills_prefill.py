"""One prefill through the group managers (`prefill.run_prefill`), exactly: where its chunks stop
and which page each snapshot copies. Written to kill mutants `make mutants` found surviving in
cache_service/prefill.py."""

from __future__ import annotations

from cache_service import EagleMode, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.group_managers import GroupManagers
from cache_service.prefill import StoreResult, run_prefill
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import make_layout

COORD = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
HASHES = RequestBlockHashes(16, make_tokens(300, 3, 1000))


def warm_prefill(checkpoints):
    """A prefill of 256 tokens over a cached hit of 64; what it leaves in the cache."""
    cache = LocalPrefixCache(COORD, [40, 8])
    assert cache.store_prefix(HASHES, 64, (64,)) == StoreResult(True, (4, 1), (0, 0))
    result = cache.store_prefix(HASHES, 256, checkpoints, hit_tokens=64)
    mamba = cache.groups.managers[1]
    return result, mamba.eviction.now, dict(mamba.eviction.known()), [set(p.cached) for p in cache.pools]


def test_a_checkpoint_at_the_hit_is_not_a_chunk_stop():
    # chunks stop at checkpoints past the hit only; a stop at the hit touches the hit's snapshot
    # once more, in the same request (the eviction clock counts requests): nothing changes
    assert warm_prefill((64, 128, 256)) == warm_prefill((128, 256))


class WorkingPageCheck:
    """Records each copy with the request's working page at that moment."""

    def __init__(self) -> None:
        self.groups: GroupManagers | None = None
        self.copies: list[tuple[int, int, int]] = []

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        self.copies.append((src, dst, self.groups.managers[1].working_page("r")))


def test_each_snapshot_copies_the_working_state_of_the_request():
    # kills x_run_prefill__mutmut_59: a run over a real page backend snapshots the state the
    # request's working page holds after each chunk, not some other page
    backend = WorkingPageCheck()
    backend.groups = GroupManagers(COORD, [BlockPool(40, 0), BlockPool(8, 1)], backend)
    assert run_prefill(backend.groups, "r", HASHES, 0, 256, (64, 128, 256)) == StoreResult(True, (16, 3), (0, 0))
    assert len(backend.copies) == 3
    assert all(src == working and dst != working for src, dst, working in backend.copies)
