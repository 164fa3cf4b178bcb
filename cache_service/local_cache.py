"""A replica-local prefix cache: one block pool per group behind the `CacheLookup` interface.

The engine allocates and publishes blocks itself as prefill chunks complete; `store_prefix`
is the same publication done in one go, used by simulations (`explain`, property tests,
benchmarks) so that they exercise the real pools, eviction and events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.hit_finders import DropRule
from cache_service.specs import MambaSpec, SlidingWindowSpec


class PoolLookup:
    """`CacheLookup` over a replica's block pools (read-only: no LRU touch)."""

    def __init__(self, pools: Sequence[BlockPool]) -> None:
        self.pools = pools

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        return block_hash in self.pools[group_id].cached


class StoreResult(NamedTuple):
    num_stored_blocks: tuple[int, ...]  # newly published blocks (or state pages) per group
    num_skipped_blocks: tuple[int, ...]  # per group: not stored because the pool had no room


def retained_block_ends(
    spec, num_computed_tokens: int, checkpoints: Sequence[int], lookahead: bool = False
) -> list[int]:
    """Token positions at which group `spec` keeps a cached block (the block's end position).

    full/draft: every full block; sliding window: only the blocks covering each checkpoint's
    window tail, plus, for a group whose lookup drops by the lookahead rule (`lookahead`), the
    block starting at each checkpoint (the proof of its successor token); mamba: one state page
    per checkpoint."""
    size = spec.block_size
    if isinstance(spec, MambaSpec):
        return [c for c in checkpoints if c % size == 0]
    if isinstance(spec, SlidingWindowSpec):
        ends: set[int] = set()
        for c in checkpoints:
            first = max(0, c - (spec.window - 1)) // size
            ends.update((j + 1) * size for j in range(first, c // size))
            if lookahead and c % size == 0 and c + size <= num_computed_tokens:
                ends.add(c + size)
        return sorted(ends)
    return list(range(size, num_computed_tokens // size * size + 1, size))


class LocalPrefixCache:
    def __init__(
        self,
        coordinator: HybridCoordinator,
        num_blocks_per_group: Sequence[int],
        events: EventSink | None = None,
    ) -> None:
        layout = coordinator.layout
        if len(num_blocks_per_group) != len(layout.groups):
            raise ValueError("one pool size per group is needed")
        self.coordinator = coordinator
        self.events = events if events is not None else EventSink()
        self.pools = [BlockPool(n, g, self.events) for g, n in enumerate(num_blocks_per_group)]
        self.lookup_view = PoolLookup(self.pools)

    def lookup(self, hashes: RequestBlockHashes, num_prompt_tokens: int) -> HitResult:
        return self.coordinator.find_longest_hit(hashes.hashes, num_prompt_tokens, self.lookup_view)

    def store_prefix(
        self, hashes: RequestBlockHashes, num_computed_tokens: int, checkpoints: Sequence[int]
    ) -> StoreResult:
        """Publish what a finished request leaves behind: blocks and snapshots per retention."""
        stored, skipped = [], []
        coord = self.coordinator
        for g, (pool, spec) in enumerate(zip(self.pools, coord.layout.groups)):
            num_new = num_skip = 0
            lookahead = g in coord.dropping_groups and coord.drop_rule is DropRule.LOOKAHEAD
            for end in retained_block_ends(spec, num_computed_tokens, checkpoints, lookahead):
                key = hashes.prefix_hash(end)
                if key in pool.cached:
                    continue
                if not pool.can_allocate(1):
                    num_skip += 1
                    continue
                (block,) = pool.allocate(1)
                pool.cache_block(block, key)
                pool.free([block])
                num_new += 1
            stored.append(num_new)
            skipped.append(num_skip)
        return StoreResult(tuple(stored), tuple(skipped))

    def check_integrity(self) -> None:
        for pool in self.pools:
            pool.check_integrity()
