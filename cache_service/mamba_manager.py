"""The Mamba group's manager: state pages per request, and retained checkpoints under a budget.

    a running request holds     working page      the state after num_computed tokens
                                boundary pages    (decoding) states at the last two alignment
                                                  boundaries passed, for the next chat turn
                                verify pages      (decoding, speculation) the state after each
                                                  verified token, for rollback
    retained checkpoints        snapshots: a copy of a state into a fresh page, published under
                                the prefix hash of its position and released at once

Working, boundary and verify pages are in use (ref_cnt > 0) and never evicted. Retained
checkpoints are: at most `max_retained_pages` of them (the byte budget), and when one must go
(the budget is full, or a page is needed and only cached ones are free) the eviction policy
(`eviction.py`: lru, marconi or value) names it; a snapshot the policy does not admit is not
taken (`num_snapshots_skipped`). Every retained state is reported to `support`
(`kv_support.py`, when the policy values KV jointly): the attention blocks it makes usable.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool, CacheBlock
from cache_service.eviction_policy import CheckpointEviction
from cache_service.kv_support import KvSupport
from cache_service.value_eviction import ValueEviction


@dataclass
class MambaSlots:
    working: CacheBlock
    boundary: list[CacheBlock]
    boundary_positions: list[int]  # oldest first
    verify: list[CacheBlock]


class MambaManager:
    def __init__(self, group_id, spec, pool: BlockPool, coordinator, backend, num_verify_pages: int = 0,
                 max_retained_pages: int | None = None, page_size_bytes: int = 1,
                 eviction: CheckpointEviction | None = None, support: KvSupport | None = None) -> None:
        self.group_id, self.spec, self.pool = group_id, spec, pool
        self.coordinator, self.backend = coordinator, backend
        self.block_size = spec.block_size
        self.num_verify_pages = num_verify_pages
        self.max_retained_pages = max_retained_pages
        self.page_size_bytes = max(1, page_size_bytes)
        self.slots: dict[str, MambaSlots] = {}
        self.eviction = eviction if eviction is not None else ValueEviction(self.page_size_bytes)
        self.support = support
        self.num_snapshots = 0
        self.num_snapshots_skipped = 0
        self.num_evictions = 0

    # ---- the group-manager interface --------------------------------------------------------
    def hit_blocks(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock]:
        return []  # nothing is shared: the state is copied into the request's working page

    def copy_sources(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock]:
        return [self.pool.get_cached(key) for key in self.hit_keys(hashes, hit_tokens)]

    def hit_keys(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
        """The key of the state a hit of `hit_tokens` restores (none for no hit)."""
        return [hashes.prefix_hash(hit_tokens)] if hit_tokens else []

    @property
    def num_decode_pages(self) -> int:
        return 2 + self.num_verify_pages

    def num_blocks_needed(self, request_id: str, num_positions: int, decoding: bool = False) -> int:
        slots = self.slots.get(request_id)
        if slots is None:
            return 1 + (self.num_decode_pages if decoding else 0)
        return self.num_decode_pages if decoding and not slots.boundary else 0

    def restore(self, request_id: str, hashes: RequestBlockHashes, hit_tokens: int) -> None:
        self.eviction.tick()
        self.eviction.missed(hashes.hashes, hit_tokens // hashes.hash_block_size)
        if self.pool.host is not None:
            self.pool.host.tick()
        (src,) = self.copy_sources(hashes, hit_tokens) or (None,)
        if src is not None:
            self.pool.touch([src])  # pinned: allocating the working page must not recycle it
        (working,) = self._allocate(1)
        self.slots[request_id] = MambaSlots(working, [], [], [])
        if src is not None:
            self.backend.copy_page(self.group_id, src.block_id, working.block_id)
            self.pool.free([src])
            self._adopt()
            self.eviction.used(src.block_hash, True, hit_tokens)

    def grow(self, request_id: str, num_positions: int, decoding: bool = False) -> None:
        slots = self.slots[request_id]
        if decoding and not slots.boundary:
            pages = self._allocate(self.num_decode_pages)
            slots.boundary, slots.verify = pages[:2], pages[2:]

    def publish(self, request_id, hashes, num_computed, checkpoints=()) -> int:
        return 0  # snapshots are taken where the engine's chunks stop (`snapshot`)

    def free(self, request_id: str) -> None:
        slots = self.slots.pop(request_id, None)
        if slots is not None:
            self.pool.free([slots.working, *slots.boundary, *slots.verify])

    def holds(self, request_id: str) -> bool:
        return request_id in self.slots

    # ---- states -------------------------------------------------------------------------------
    def working_page(self, request_id: str) -> int:
        return self.slots[request_id].working.block_id

    def verify_pages(self, request_id: str, num: int) -> tuple[int, ...]:
        return tuple(p.block_id for p in self.slots[request_id].verify[:num])

    def rollback(self, request_id: str, num_accepted: int) -> None:
        """After a verify chunk that accepted `num_accepted` drafts (fewer than proposed): the
        working state becomes the state after the last accepted token."""
        slots = self.slots[request_id]
        self.backend.copy_page(self.group_id, slots.verify[num_accepted].block_id, slots.working.block_id)

    def track_boundary(self, request_id: str, position: int, src_page: int) -> None:
        """Keep the state at `position` (an alignment boundary passed while decoding; it is in
        `src_page` now) in one of the two boundary pages, replacing the oldest."""
        slots = self.slots[request_id]
        if len(slots.boundary_positions) == 2:
            slots.boundary.append(slots.boundary.pop(0))
            slots.boundary_positions.pop(0)
        page = slots.boundary[len(slots.boundary_positions)]
        self.backend.copy_page(self.group_id, src_page, page.block_id)
        slots.boundary_positions.append(position)

    def boundary_states(self, request_id: str) -> list[tuple[int, int]]:
        """(position, page id) of the kept decode boundaries, oldest first."""
        slots = self.slots.get(request_id)
        if slots is None:
            return []
        return [(pos, page.block_id) for pos, page in zip(slots.boundary_positions, slots.boundary)]

    # ---- retained checkpoints -----------------------------------------------------------------
    def snapshot(self, hashes: RequestBlockHashes, src_page: int, position: int, periodic: bool = False) -> bool:
        """Retain the state in `src_page` (the state after `position` tokens) as a checkpoint,
        within the budget. False when not taken (already cached, not admitted, no room).
        `periodic`: a retention grid position only (the policy ranks those below boundaries)."""
        if position <= 0 or position % self.block_size:
            return False
        key = hashes.prefix_hash(position)
        self._adopt()
        if key in self.pool.cached:
            self.eviction.used(key, False, position)
            return False
        parent = self._retained_below(hashes, position)
        over_budget = self.max_retained_pages is not None and self.num_retained >= self.max_retained_pages
        if over_budget or not self.pool.num_free_empty_blocks:  # taking it means evicting one
            victim = self.eviction.victim(self._evictable)
            if victim is not None and parent and victim == hashes.prefix_hash(parent):
                parent = self._retained_below(hashes, parent)  # the parent itself would go
            if victim is None or not self.eviction.admits(position, parent, victim, periodic):
                if victim is not None:
                    self.eviction.refused(key)
                self.num_snapshots_skipped += 1
                return False
            self._evict(self.pool.cached[victim])
        if not self._can_take(1):
            self.num_snapshots_skipped += 1
            return False
        (page,) = self._allocate(1)
        self.backend.copy_page(self.group_id, src_page, page.block_id)
        self.pool.cache_block(page, key)
        self.pool.free([page])
        self.eviction.stored(key, position, parent, periodic)
        if self.support is not None:
            self.support.stored(self.group_id, key, hashes, position)
        self.num_snapshots += 1
        return True

    def _retained_below(self, hashes: RequestBlockHashes, position: int) -> int:
        """The position of the nearest retained state below `position` on this prefix that has
        served a hit (0: none): what a hit at `position` saves more than."""
        cached, reused = self.pool.cached, self.eviction.is_reused
        for below in range(position - self.block_size, 0, -self.block_size):
            key = hashes.prefix_hash(below)
            if key in cached and reused(key):
                return below
        return 0

    @property
    def num_retained(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def num_retained_bytes(self) -> int:
        return self.num_retained * self.page_size_bytes

    def _evictable(self, key: BlockHash) -> bool | None:
        block = self.pool.cached.get(key)
        return None if block is None else not block.ref_cnt

    def _adopt(self) -> None:
        """Pages cached behind the policy's back (a transfer registers pages in the pool) join it
        as states of no known value (position 0): the first to go."""
        known, cached = self.eviction.known(), self.pool.cached
        if len(known) != len(cached):  # O(1) unless something changed behind the policy's back
            for key in known.keys() - cached.keys():
                self.eviction.removed(key)
                self._left_device(key)
            for key in cached.keys() - known.keys():
                self.eviction.stored(key, 0, 0)
                if self.support is not None:
                    self.support.stored(self.group_id, key, None, 0)

    def _evict(self, block: CacheBlock) -> None:
        key = block.block_hash
        self.eviction.evicted(key)
        self.pool.evict(key)  # demoted to the host tier, when there is one and it takes it
        self.eviction.removed(key)
        self._left_device(key)
        self.num_evictions += 1

    def _left_device(self, key: BlockHash) -> None:
        """A state left the device pool: the KV it makes usable stays kept while the host holds it."""
        if self.support is not None and (self.pool.host is None or key not in self.pool.host):
            self.support.removed(self.group_id, key)

    def attach_host(self) -> None:
        """The pool's host tier ranks demoted states by their device position and releases their
        KV support when it drops them (unless the device holds them again)."""
        host = self.pool.host
        host.position_of = self.eviction.position_of

        def dropped(key: BlockHash) -> None:
            if self.support is not None and key not in self.pool.cached:
                self.support.removed(self.group_id, key)

        host.on_dropped = dropped

    def _num_free_uncached(self) -> int:
        return self.pool.num_free_empty_blocks

    def _can_take(self, num: int) -> bool:
        return self.pool.can_allocate(num)

    def _allocate(self, num: int) -> list[CacheBlock]:
        """Take `num` pages, evicting the retained checkpoints the policy names first."""
        needed = num - self._num_free_uncached()
        if needed > 0:
            self._adopt()
        for _ in range(max(0, needed)):
            victim = self.eviction.victim(self._evictable)
            if victim is None:
                break
            self._evict(self.pool.cached[victim])
        return self.pool.allocate(num)  # empty pages first: they sit at the free queue's head
