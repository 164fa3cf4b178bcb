"""One simulated replica: a real `LocalPrefixCache` (pools sized from page bytes and a memory
budget, with the per-kind group managers over them) and its event feed into the global index.

A request's blocks are published when its prefill finishes (`publish`), not when it is routed,
so a request arriving while a sibling is still prefilling does not hit what is not there yet.
Publication is the engine's, through the same group managers (`LocalPrefixCache.store_prefix`
-> `prefill.run_prefill`): the hit restored (its pages pinned and copied, LRU and reuse stats
refreshed), pages taken for the rest of the prompt (evicting LRU blocks; Mamba checkpoints by
expected value), complete blocks published under their prefix hashes (a copy already cached
stays private: "first copy wins"), snapshots taken at the checkpoints past the hit, everything
freed tail first. Events travel as the wire's `BlockRecord`s through `GlobalIndex.apply_batch`,
the path pushed batches take in the live service.

With a host tier (`host_pages`), pages the pools evict are demoted to it and a hit's host-only
pages are promoted when the hit is restored (`promotion.py`, inside the same admission);
`promoted_bytes` prices that copy when the request is served, as the engine would pay it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.eviction import EvictionConfig
from cache_service.global_index import GlobalIndex
from cache_service.local_cache import LocalPrefixCache
from cache_service.messages import BlockRecord, RecordKind
from cache_service.prefill import StoreResult
from cache_service.promotion import host_only
from cache_service.retention import CheckpointPlanner


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

    def host_stored(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        self._records += [BlockRecord(RecordKind.HOST_STORED, key, 1 << group_id) for key in block_hashes]
        self._next_seq += bool(block_hashes)

    def host_removed(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        self._records += [BlockRecord(RecordKind.HOST_REMOVED, key, 1 << group_id) for key in block_hashes]
        self._next_seq += bool(block_hashes)

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
        eviction: EvictionConfig | None = None,
        state_page_bytes: int = 1,
        max_retained_pages: int | None = None,
        host_pages: Sequence[int] = (),
        page_bytes: Sequence[int] = (),
    ) -> None:
        """`host_pages`: per group, the pages of its host tier (none: no tier); `page_bytes`: per
        group, one page's bytes (what `promoted_bytes` counts; needed with a host tier)."""
        if host_pages and len(page_bytes) != len(coordinator.layout.groups):
            raise ValueError("a replica with a host tier needs one page size per group")
        self.replica_id = replica_id
        self.planner = planner
        self.coordinator = coordinator
        self.cache = LocalPrefixCache(coordinator, num_blocks_per_group, RecordSink(replica_id), eviction,
                                      state_page_bytes, max_retained_pages, host_pages)
        self.page_bytes = tuple(page_bytes)
        self.index = index
        if index is not None:
            index.add_replica(replica_id)
        self.num_refused_prefills = 0  # prompts the pools could not hold at once: nothing stored
        self.num_stored_blocks = [0] * len(coordinator.layout.groups)  # published over the run, per group

    # ---- cache ----------------------------------------------------------------------------
    def lookup(self, hashes: RequestBlockHashes, num_prompt_tokens: int) -> HitResult:
        """The coordinator over this replica's pools, as a worker admits a request (without each
        group's own answer at the cap, which only explanations use)."""
        return self.coordinator.find_longest_hit(hashes.hashes, num_prompt_tokens, self.cache.lookup_view,
                                                 per_group=False)

    def promoted_bytes(self, hashes: RequestBlockHashes, hit_tokens: int) -> int:
        """Bytes admitting a hit of `hit_tokens` copies back from the host tier now: its host-only
        pages (`promotion.host_only`) times each group's page bytes. Read-only."""
        if not hit_tokens:
            return 0
        return sum(len(host_only(m, hashes, hit_tokens)) * b
                   for m, b in zip(self.cache.groups.managers, self.page_bytes) if m.pool.host is not None)

    def publish(self, hashes: RequestBlockHashes, hit_tokens: int, num_tokens: int,
                junctions: Sequence[int]) -> StoreResult:
        """Store what a finished prefill of `num_tokens` that hit `hit_tokens` leaves behind (the
        checkpoints retention plans, junctions included), then feed the events to the index. The
        hit was looked up when the request was served; the engine pins its pages from then on, so
        if another publication here has evicted some since, what is still cached is restored."""
        if hit_tokens and not self.cache.groups.holds_hit(hashes, hit_tokens):
            hit_tokens = self.lookup(hashes, hit_tokens + 1).hit_tokens
        return self._store(hashes, hit_tokens, num_tokens, self.planner.checkpoints(num_tokens, num_tokens, junctions),
                           self.planner.periodic(num_tokens, num_tokens, junctions))

    def receive_transfer(self, hashes: RequestBlockHashes, num_tokens: int) -> StoreResult:
        """Pages of a `num_tokens` prefix pushed from another replica (KV blocks + the snapshot),
        registered as a prefill of that prefix over this replica's own hit. (The live receiver,
        `workers/transfer.py`, takes pages only for the keys it lacks; here KV already cached past
        the own hit also gets fresh pages, as on a recompute: slightly more eviction, on the few
        requests that move pages.)"""
        return self._store(hashes, self.lookup(hashes, num_tokens + 1).hit_tokens, num_tokens, (num_tokens,))

    def _store(self, hashes: RequestBlockHashes, hit_tokens: int, num_tokens: int,
               checkpoints: Sequence[int], periodic: frozenset[int] = frozenset()) -> StoreResult:
        result = self.cache.store_prefix(hashes, num_tokens, checkpoints, hit_tokens, periodic)
        self.num_refused_prefills += not result.admitted
        self.num_stored_blocks = [a + b for a, b in zip(self.num_stored_blocks, result.num_stored_blocks)]
        self.flush_events()
        return result

    def flush_events(self) -> None:
        first, end, records = self.cache.events.take_batch()
        if self.index is not None and end > first:
            applied = self.index.apply_batch(self.replica_id, first, end, records)
            if applied.needs_resync:  # cannot happen in-process; a bug if it does
                raise RuntimeError(f"{self.replica_id}: event sequence gap in the simulation")

    def cached_bytes(self, page_bytes: Sequence[int]) -> tuple[int, ...]:
        return tuple(pool.num_cached_blocks * b for pool, b in zip(self.cache.pools, page_bytes))
