"""The engine's cache: one block pool per group, prefix hits restored into a request, blocks
and Mamba snapshots published as they complete.

    group 0  full   target attention KV blocks      (kv_block_size tokens each)
    group 1  mamba  Mamba state pages               (one page = conv + ssm state of all layers)
    group 2  draft  MTP layer attention KV blocks   (only with speculation)

Every pool block id is also the row of the model's cache tensors, so a block table is just the
ids. Mamba pages serve three roles: a request's working state, its per-token verify states
(speculative rollback) and cached snapshots; a snapshot is a copy of the working state into a
fresh page that is published under the prefix hash of its position and released at once.

Admission allocates every KV block a request can ever write (prompt + max_tokens + k), so a
running request never runs out of memory and nothing is preempted; requests that do not fit
wait. A per-block hidden-state sidecar (the target's last-position hidden, a few KB) backs
lossless EAGLE: on a hit of L the draft layer's KV at L-1 is recomputed from it.
"""

from __future__ import annotations

import torch

from cache_service.block_pool import BlockPool, CacheBlock
from cache_service.coordinator import EagleMode, HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.local_cache import PoolLookup
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.specs import CacheLayout, DraftAttentionSpec, FullAttentionSpec, MambaSpec
from workers.engine.config import EngineConfig
from workers.engine.request import Request

FULL, MAMBA, DRAFT = 0, 1, 2


class EngineCacheManager:
    def __init__(
        self,
        config: EngineConfig,
        caches,  # workers.model.caches.ModelCaches
        num_kv_blocks: int,
        num_state_slots: int,
        hidden_size: int,
        speculative: bool,
        events: EventSink | None = None,
    ) -> None:
        self.config = config
        self.caches = caches
        self.speculative = speculative
        groups = [FullAttentionSpec(config.kv_block_size), MambaSpec(config.mamba_block_size)]
        if speculative:
            groups.append(DraftAttentionSpec(config.kv_block_size))
        self.layout = CacheLayout(tuple(groups))
        eagle = config.eagle_mode if speculative else EagleMode.OFF
        self.coordinator = HybridCoordinator(self.layout, eagle, drop_rule=config.drop_rule)
        self.planner = CheckpointPlanner(self.coordinator, make_retention(config.retention, self.layout.alignment))
        self.events = events if events is not None else EventSink(enabled=False)  # no consumer: keep nothing
        self.pools = [BlockPool(num_kv_blocks, FULL, self.events), BlockPool(num_state_slots, MAMBA, self.events)]
        if speculative:
            self.pools.append(BlockPool(num_kv_blocks, DRAFT, self.events))
        self.lookup_view = PoolLookup(self.pools)
        # [blocks, hidden] target h at block end - 1, beside the KV it belongs to (config.device)
        self.sidecar = torch.zeros(num_kv_blocks, hidden_size, device=config.device)
        self.num_snapshots_skipped = 0

    @property
    def alignment(self) -> int:
        return self.layout.alignment

    @property
    def block_size(self) -> int:
        return self.config.kv_block_size

    # ---- sizing ---------------------------------------------------------------------------
    def num_kv_blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def num_state_slots_per_request(self) -> int:
        # working + two decode-boundary slots (+ k+1 verify states)
        return 3 + (self.config.num_spec_tokens + 1 if self.speculative else 0)

    def max_positions(self, req: Request) -> int:
        k = self.config.num_spec_tokens if self.speculative else 0
        return req.num_prompt_tokens + req.params.max_tokens + k

    def fits_at_all(self, req: Request) -> bool:
        blocks = self.num_kv_blocks_for(self.max_positions(req))
        slots = self.num_state_slots_per_request()
        return blocks < self.pools[FULL].num_blocks and slots + 1 < self.pools[MAMBA].num_blocks

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, req: Request) -> HitResult:
        if not self.config.enable_prefix_caching:
            return HitResult(0, tuple(0 for _ in self.layout.groups), 0, (0,))
        return self.coordinator.find_longest_hit(req.hashes.hashes, req.num_prompt_tokens, self.lookup_view)

    def try_admit(self, req: Request) -> bool:
        """Look up the prefix hit and, if the pools have room, give the request its blocks with
        the hit restored (KV blocks shared, Mamba state copied into its working page)."""
        hit = self.lookup(req)
        length = hit.hit_tokens
        num_hit_blocks = length // self.block_size
        total = self.num_kv_blocks_for(self.max_positions(req))
        full = self.pools[FULL]
        hit_blocks = [full.get_cached(req.hashes.prefix_hash((j + 1) * self.block_size)) for j in range(num_hit_blocks)]
        need_full = total - num_hit_blocks + sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if not full.can_allocate(need_full):
            return False
        draft_hit: list[CacheBlock] = []
        if self.speculative:
            draft = self.pools[DRAFT]
            shared = num_hit_blocks - 1 if length and self.config.eagle_mode is EagleMode.LOSSLESS else num_hit_blocks
            draft_hit = [draft.get_cached(req.hashes.prefix_hash((j + 1) * self.block_size)) for j in range(shared)]
            need_draft = total - len(draft_hit) + sum(1 for b in draft_hit if b.ref_cnt == 0)
            if not draft.can_allocate(need_draft):
                return False
        mamba = self.pools[MAMBA]
        page = mamba.get_cached(req.hashes.prefix_hash(length)) if length else None
        pinned = 1 if page is not None and page.ref_cnt == 0 else 0  # pinning it takes it off the free queue
        if not mamba.can_allocate(self.num_state_slots_per_request() + 1 + pinned):  # +1: room for a snapshot
            return False
        draft_src = None
        if self.speculative and len(draft_hit) < num_hit_blocks:  # lossless: the block holding L-1
            draft_src = self.pools[DRAFT].get_cached(req.hashes.prefix_hash(length))
            if draft_src.ref_cnt == 0 and not self.pools[DRAFT].can_allocate(need_draft + 1):
                return False
        # act: nothing below can fail. The hit's pages are pinned before any allocation, which
        # may evict free cached pages, so the pages being restored from are never recycled.
        full.touch(hit_blocks)
        if page is not None:
            mamba.touch([page])
        if draft_src is not None:
            self.pools[DRAFT].touch([draft_src])
        req.kv_blocks = hit_blocks + full.allocate(total - num_hit_blocks)
        slots = mamba.allocate(self.num_state_slots_per_request())
        req.state_slot, req.final_slots, req.verify_slots = slots[0], slots[1:3], slots[3:]
        if page is not None:
            self.caches.copy_state(page.block_id, req.state_slot.block_id)
            mamba.free([page])
        if self.speculative:
            draft = self.pools[DRAFT]
            draft.touch(draft_hit)
            req.draft_blocks = draft_hit + draft.allocate(total - len(draft_hit))
            if draft_src is not None:  # lossless: private copy of the block holding L-1
                self._copy_draft_block(draft_src.block_id, req.draft_blocks[num_hit_blocks - 1].block_id)
                draft.free([draft_src])
        req.num_cached_tokens = req.num_computed_tokens = length
        req.num_draft_computed_tokens = length if self.config.eagle_mode is EagleMode.DROP or not length else length - 1
        req.num_published = [num_hit_blocks, 0, len(draft_hit)]
        req.junctions = self.coordinator.junctions(hit)
        req.checkpoints = self.planner.checkpoints(req.num_prompt_tokens, req.num_prompt_tokens, req.junctions)
        return True

    def _copy_draft_block(self, src: int, dst: int) -> None:
        for k_cache, v_cache in self.caches.draft_kv.values():
            k_cache[dst].copy_(k_cache[src])
            v_cache[dst].copy_(v_cache[src])

    def hit_sidecar(self, req: Request) -> torch.Tensor:
        """Target hidden state at position num_cached_tokens - 1 (lossless EAGLE)."""
        block = req.kv_blocks[req.num_cached_tokens // self.block_size - 1]
        return self.sidecar[block.block_id]

    # ---- publication ----------------------------------------------------------------------
    def record_hidden(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """Keep the sidecar rows of blocks whose last position lies in [start, start + len)."""
        size = self.block_size
        first = -(-(start + 1) // size)  # first block end >= start + 1
        for end in range(first * size, start + hidden.shape[0] + 1, size):
            self.sidecar[req.kv_blocks[end // size - 1].block_id] = hidden[end - 1 - start]

    def publish(self, req: Request) -> None:
        """Publish every newly completed target and draft block under its prefix hash."""
        if not self.config.enable_prefix_caching:
            return
        size = self.block_size
        for group, blocks, done in ((FULL, req.kv_blocks, req.num_computed_tokens),
                                    (DRAFT, req.draft_blocks, req.num_draft_computed_tokens)):
            if group >= len(self.pools):
                continue
            pool = self.pools[group]
            upto = min(done, len(req.hashes.hashes) * self.layout.hash_block_size) // size
            for j in range(req.num_published[group], upto):
                pool.cache_block(blocks[j], req.hashes.prefix_hash((j + 1) * size))
            req.num_published[group] = max(req.num_published[group], upto)

    def snapshot(self, req: Request, slot: CacheBlock, position: int) -> bool:
        """Publish the Mamba state in `slot` (the state after `position` tokens) as a snapshot."""
        if not self.config.enable_prefix_caching or position <= 0 or position % self.config.mamba_block_size:
            return False
        mamba = self.pools[MAMBA]
        key = req.hashes.prefix_hash(position)
        if key in mamba.cached:
            return False
        if not mamba.can_allocate(1):
            self.num_snapshots_skipped += 1
            return False
        (page,) = mamba.allocate(1)
        self.caches.copy_state(slot.block_id, page.block_id)
        mamba.cache_block(page, key)
        mamba.free([page])
        return True

    def release(self, req: Request) -> None:
        """Return all of a request's blocks; cached ones stay cached (LRU, tail first)."""
        self.pools[FULL].free(reversed(req.kv_blocks))
        if self.speculative:
            self.pools[DRAFT].free(reversed(req.draft_blocks))
        slots = [s for s in [req.state_slot, *req.final_slots, *req.verify_slots] if s is not None]
        self.pools[MAMBA].free(slots)
        req.kv_blocks, req.draft_blocks, req.verify_slots, req.final_slots = [], [], [], []
        req.state_slot = None

    def check_integrity(self) -> None:
        for pool in self.pools:
            pool.check_integrity()
