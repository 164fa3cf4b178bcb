"""One simulated replica: a real `LocalPrefixCache` (pools sized from page bytes and a memory
budget) with its event feed into the global index, and its prefill queue in simulated time.

A request's blocks are published when its prefill finishes (`publish`), not when it is routed,
so a request arriving while a sibling is still prefilling does not hit what is not there yet.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from cache_service.block_hash import RequestBlockHashes
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.global_index import GlobalIndex
from cache_service.local_cache import LocalPrefixCache, StoreResult, retained_block_ends
from cache_service.retention import CheckpointPlanner


class PrefillQueue:
    """A replica's compute in simulated time: one prefill at a time (FCFS), decode batched
    beside it (each request's decode runs for its own output length once its prefill ends).

    Its load is what a live replica reports (`messages.LoadReportMsg.num_queued_tokens`):
    prompt tokens still to prefill (the running prefill's remaining share included) plus output
    tokens still to decode."""

    def __init__(self, decode_step_s: float = 0.0) -> None:
        self.decode_step_s = decode_step_s
        self.busy_until = 0.0
        self._prefills: deque[tuple[float, float, int, float]] = deque()  # (start, first, tokens, finish)
        self._num_prefill_tokens = 0  # summed over `_prefills`
        self._decoding: list[float] = []  # finish times of requests past their prefill (a heap)
        self._sum_decode_finish = 0.0

    def queued_prefill_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def _advance(self, now: float) -> None:
        prefills, decoding = self._prefills, self._decoding
        while prefills and prefills[0][1] <= now:
            _, _, tokens, finish = prefills.popleft()
            self._num_prefill_tokens -= tokens
            heapq.heappush(decoding, finish)
            self._sum_decode_finish += finish
        while decoding and decoding[0] <= now:
            self._sum_decode_finish -= heapq.heappop(decoding)

    def num_in_flight(self, now: float) -> int:
        self._advance(now)
        return len(self._prefills) + len(self._decoding)

    def queued_tokens(self, now: float) -> int:
        """Prompt tokens still to prefill + output tokens still to decode at `now`."""
        self._advance(now)
        prefill = self._num_prefill_tokens
        if self._prefills:
            start, first, tokens, _ = self._prefills[0]
            if start < now:  # the running prefill: its remaining share
                prefill -= round(tokens * (now - start) / (first - start))
        decode = 0
        if self._decoding and self.decode_step_s > 0:
            decode = round((self._sum_decode_finish - len(self._decoding) * now) / self.decode_step_s)
        return prefill + max(0, decode)

    def admit(self, now: float, prefill_s: float, decode_s: float, num_prefill_tokens: int) -> tuple[float, float]:
        """Queue a prefill of `num_prefill_tokens` taking `prefill_s`; returns (first-token time,
        finish time)."""
        start = max(now, self.busy_until)
        first = start + prefill_s
        self.busy_until = first
        finish = first + decode_s
        self._prefills.append((start, first, num_prefill_tokens, finish))
        self._num_prefill_tokens += num_prefill_tokens
        return first, finish


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
        self.cache = LocalPrefixCache(coordinator, num_blocks_per_group, EventSink(replica_id))
        self.index = index
        if index is not None:
            index.add_replica(replica_id)
        self.num_skipped_blocks = 0

    # ---- cache ----------------------------------------------------------------------------
    def lookup(self, hashes: RequestBlockHashes, num_prompt_tokens: int) -> HitResult:
        return self.cache.lookup(hashes, num_prompt_tokens)

    def touch_hit(self, hashes: RequestBlockHashes, hit_tokens: int) -> None:
        """Refresh LRU for the blocks a hit reused (the engine references them while serving)."""
        if not hit_tokens:
            return
        for pool, spec in zip(self.cache.pools, self.cache.coordinator.layout.groups):
            blocks = []
            for end in retained_block_ends(spec, hit_tokens, (hit_tokens,)):
                block = pool.get_cached(hashes.prefix_hash(end))
                if block is not None and block.ref_cnt == 0:
                    blocks.append(block)
            pool.touch(blocks)
            pool.free(reversed(blocks))

    def publish(self, hashes: RequestBlockHashes, num_tokens: int, junctions: Sequence[int]) -> StoreResult:
        """Store what a finished prefill leaves behind, then feed the events to the index."""
        checkpoints = self.planner.checkpoints(num_tokens, num_tokens, junctions)
        result = self.cache.store_prefix(hashes, num_tokens, checkpoints)
        self.num_skipped_blocks += sum(result.num_skipped_blocks)
        self.flush_events()
        return result

    def receive_transfer(self, hashes: RequestBlockHashes, num_tokens: int) -> StoreResult:
        """Pages of a `num_tokens` prefix pushed from another replica (KV blocks + the snapshot)."""
        result = self.cache.store_prefix(hashes, num_tokens, (num_tokens,))
        self.flush_events()
        return result

    def flush_events(self) -> None:
        events = self.cache.events.drain()
        if self.index is not None and events:
            applied = self.index.apply(self.replica_id, events)
            if applied.needs_resync:  # cannot happen in-process; a bug if it does
                raise RuntimeError(f"{self.replica_id}: event sequence gap in the simulation")

    def cached_bytes(self, page_bytes: Sequence[int]) -> tuple[int, ...]:
        return tuple(pool.num_cached_blocks * b for pool, b in zip(self.cache.pools, page_bytes))
