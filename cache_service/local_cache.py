"""A replica-local prefix cache: one block pool per group behind the `CacheLookup` interface,
and the per-kind group managers over those pools (null page backend).

The engine runs its own managers over pools backed by tensors; this cache is what simulations
use (`simulate.py`, `explain`, the trace simulator, property tests, benchmarks), so that they
exercise the real pools, eviction, events and publication (`store_prefix`, through
`prefill.run_prefill`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.eviction import EvictionConfig
from cache_service.group_managers import GroupManagers
from cache_service.prefill import StoreResult, run_prefill


class PoolLookup:
    """`CacheLookup` over a replica's block pools and their host tiers (read-only: no LRU touch;
    a host page counts as cached: admission promotes it)."""

    def __init__(self, pools: Sequence[BlockPool]) -> None:
        self.pools = pools

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        pool = self.pools[group_id]
        return block_hash in pool.cached or (pool.host is not None and block_hash in pool.host)


class LocalPrefixCache:
    def __init__(
        self,
        coordinator: HybridCoordinator,
        num_blocks_per_group: Sequence[int],
        events: EventSink | None = None,
        eviction: EvictionConfig | None = None,
        state_page_bytes: int = 1,
        max_retained_pages: int | None = None,
        host_pages: Sequence[int] = (),
    ) -> None:
        """`eviction`, `state_page_bytes` (one Mamba state page), `max_retained_pages` (the
        checkpoint budget; None: the pool's size) and `host_pages` (per group, its host tier's
        pages; none: no host tier) as the engine's managers get them."""
        layout = coordinator.layout
        if len(num_blocks_per_group) != len(layout.groups):
            raise ValueError("one pool size per group is needed")
        self.coordinator = coordinator
        self.events = events if events is not None else EventSink()
        self.pools = [BlockPool(n, g, self.events) for g, n in enumerate(num_blocks_per_group)]
        self.lookup_view = PoolLookup(self.pools)
        self.groups = GroupManagers(coordinator, self.pools, mamba_options={
            "page_size_bytes": state_page_bytes, "max_retained_pages": max_retained_pages},
                                    eviction=eviction, host_pages=host_pages)

    def lookup(self, hashes: RequestBlockHashes, num_prompt_tokens: int) -> HitResult:
        return self.coordinator.find_longest_hit(hashes.hashes, num_prompt_tokens, self.lookup_view)

    def store_prefix(
        self, hashes: RequestBlockHashes, num_computed_tokens: int, checkpoints: Sequence[int], hit_tokens: int = 0,
        periodic: Collection[int] = (),
    ) -> StoreResult:
        """Publish what a request leaves behind that restored a hit of `hit_tokens` (cached here)
        and computed up to `num_computed_tokens`, with Mamba snapshots at `checkpoints`: one
        prefill through the group managers (`prefill.run_prefill`)."""
        return run_prefill(self.groups, "store_prefix", hashes, hit_tokens, num_computed_tokens, checkpoints, periodic)

    def check_integrity(self) -> None:
        for pool in self.pools:
            pool.check_integrity()
