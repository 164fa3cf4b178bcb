"""One simulated replica: a real `LocalPrefixCache` (pools sized from page bytes and a memory
budget) with its event feed into the global index.

A request's blocks are published when its prefill finishes (`publish`), not when it is routed,
so a request arriving while a sibling is still prefilling does not hit what is not there yet.
Publication is what an engine does with a request's computed blocks, batched per group: the
blocks whose prefix hash is not cached yet are taken from the pool (evicting LRU blocks), cached
under their prefix hashes and released tail first (its last blocks are evicted first); a copy
already cached stays as it is (the engine's "first copy wins"). The blocks a hit reuses are
refreshed when the request is served (`touch_hit`). Events travel as the wire's `BlockRecord`s
through `GlobalIndex.apply_batch`, the path pushed batches take in the live service.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.global_index import GlobalIndex
from cache_service.hit_finders import DropRule
from cache_service.local_cache import LocalPrefixCache, retained_block_ends
from cache_service.messages import BlockRecord, RecordKind
from cache_service.retention import CheckpointPlanner
from cache_service.specs import MambaSpec, SlidingWindowSpec


class RecordSink(EventSink):
    """An `EventSink` that keeps wire records (one per block and group) instead of event objects:
    the same sequence numbers (one per event), no packing pass. Single-threaded (simulation)."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self._records: list[BlockRecord] = []
        self._first_seq = 0

    def stored(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:  # called once per published block (one hash): kept flat
            bit = 1 << group_id
            if len(block_hashes) == 1:
                self._records.append(BlockRecord(RecordKind.STORED, block_hashes[0], bit))
            else:
                self._records += [BlockRecord(RecordKind.STORED, key, bit) for key in block_hashes]
            self._next_seq += 1

    def removed(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:
            bit = 1 << group_id
            self._records += [BlockRecord(RecordKind.REMOVED, key, bit) for key in block_hashes]
            self._next_seq += 1

    def cleared(self, group_id: int) -> None:
        self._records.append(BlockRecord(RecordKind.CLEARED, None, 1 << group_id))
        self._next_seq += 1

    def drain(self) -> list:
        raise NotImplementedError("a RecordSink is read with take_batch")

    def take_batch(self) -> tuple[int, int, tuple[BlockRecord, ...]]:
        first, end, records = self._first_seq, self._next_seq, tuple(self._records)
        self._records.clear()
        self._first_seq = end
        return first, end, records


class SimReplica:
    """The cache side of a replica (the oracle shares one among all queues)."""

    def __init__(
        self,
        replica_id: str,
        coordinator: HybridCoordinator,
        planner: CheckpointPlanner,
        num_blocks_per_group: Sequence[int],
        index: GlobalIndex | None,
    ) -> None:
        self.replica_id = replica_id
        self.planner = planner
        self.coordinator = coordinator
        self.cache = LocalPrefixCache(coordinator, num_blocks_per_group, RecordSink(replica_id))
        self.index = index
        if index is not None:
            index.add_replica(replica_id)
        self.num_skipped_blocks = 0
        self._lookahead = [g in coordinator.dropping_groups and coordinator.drop_rule is DropRule.LOOKAHEAD
                           for g in range(len(coordinator.layout.groups))]

    # ---- cache ----------------------------------------------------------------------------
    def lookup(self, hashes: RequestBlockHashes, num_prompt_tokens: int) -> HitResult:
        """The coordinator over this replica's pools, as a worker admits a request (without each
        group's own answer at the cap, which only explanations use)."""
        return self.coordinator.find_longest_hit(hashes.hashes, num_prompt_tokens, self.cache.lookup_view,
                                                 per_group=False)

    def _keys(self, g: int, hashes: RequestBlockHashes, num_tokens: int, checkpoints: Sequence[int]) -> list:
        """The prefix keys group `g` keeps for a request (`local_cache.retained_block_ends`)."""
        spec = self.coordinator.layout.groups[g]
        chain, h = hashes.hashes, hashes.hash_block_size
        if isinstance(spec, (MambaSpec, SlidingWindowSpec)):
            return [chain[e // h - 1] for e in retained_block_ends(spec, num_tokens, checkpoints, self._lookahead[g])]
        step = spec.block_size // h
        return chain[step - 1: num_tokens // spec.block_size * step: step]

    def touch_hit(self, hashes: RequestBlockHashes, hit_tokens: int) -> None:
        """Refresh LRU for the blocks a hit reused (the engine references them while serving)."""
        if not hit_tokens:
            return
        for g, pool in enumerate(self.cache.pools):
            cached = pool.cached
            blocks = [b for b in (cached.get(k) for k in self._keys(g, hashes, hit_tokens, (hit_tokens,)))
                      if b is not None and b.ref_cnt == 0]
            pool.touch(blocks)
            pool.free(reversed(blocks))

    def publish(self, hashes: RequestBlockHashes, num_tokens: int, junctions: Sequence[int]) -> tuple[int, ...]:
        """Store what a finished prefill leaves behind, then feed the events to the index.
        Returns the number of newly stored blocks per group."""
        return self._store(hashes, num_tokens, self.planner.checkpoints(num_tokens, num_tokens, junctions))

    def receive_transfer(self, hashes: RequestBlockHashes, num_tokens: int) -> tuple[int, ...]:
        """Pages of a `num_tokens` prefix pushed from another replica (KV blocks + the snapshot)."""
        return self._store(hashes, num_tokens, (num_tokens,))

    def _store(self, hashes: RequestBlockHashes, num_tokens: int, checkpoints: Sequence[int]) -> tuple[int, ...]:
        stored = []
        for g, pool in enumerate(self.cache.pools):
            cached = pool.cached
            missing = [k for k in self._keys(g, hashes, num_tokens, checkpoints) if k not in cached]
            num_new = min(len(missing), pool.num_free_blocks)
            blocks = pool.allocate(num_new) if num_new else []
            for block, key in zip(blocks, missing):
                pool.cache_block(block, key)
            pool.free(reversed(blocks))  # tail first, as the engine frees a finished request
            self.num_skipped_blocks += len(missing) - num_new
            stored.append(num_new)
        self.flush_events()
        return tuple(stored)

    def flush_events(self) -> None:
        first, end, records = self.cache.events.take_batch()
        if self.index is not None and end > first:
            applied = self.index.apply_batch(self.replica_id, first, end, records)
            if applied.needs_resync:  # cannot happen in-process; a bug if it does
                raise RuntimeError(f"{self.replica_id}: event sequence gap in the simulation")

    def cached_bytes(self, page_bytes: Sequence[int]) -> tuple[int, ...]:
        return tuple(pool.num_cached_blocks * b for pool, b in zip(self.cache.pools, page_bytes))
