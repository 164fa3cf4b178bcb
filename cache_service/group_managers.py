"""Per-kind group managers: one object per cache group owning its pool and every request's pages.

    spec kind        manager                 a request holds
    full             FullAttentionManager    one KV block per `block_size` positions, taken lazily
    draft            DraftAttentionManager   the same for the MTP/EAGLE layers (lossless: the
                                             block holding L-1 is a private copy of the cached one)
    sliding_window   SlidingWindowManager    only the blocks a window can still read; older table
                                             entries become the null block
    mamba            MambaManager            a working state page, decode-boundary pages and
                                             verify pages (rollback); snapshots under a byte budget

Every manager answers the same questions (check-then-act): which cached pages a hit of L pins
(`hit_blocks`), how many fresh pages restoring it and growing to n positions take
(`num_blocks_needed`), then acts (`restore`, `grow`), publishes what is complete (`publish`) and
gives everything back (`free`). Callers (the engine's `EngineCacheManager`, and every simulation
through `prefill.run_prefill`) iterate over `GroupManagers.managers` and never index groups by
constant.

Page contents move through a `PageBackend`: the engine's copies tensors, `NullPageBackend`
(simulations, `explain`) copies nothing, so one publication and one restore implementation serve
both.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.attention_managers import (  # noqa: F401 - re-exported: the managers' one home for callers
    AttentionManager,
    DraftAttentionManager,
    FullAttentionManager,
    NullPageBackend,
    PageBackend,
    SlidingWindowManager,
    retained_block_ends,
)
from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import HybridCoordinator
from cache_service.eviction import EvictionConfig
from cache_service.host_tier import HostBackend, HostTier
from cache_service.kv_support import KvSupport
from cache_service.mamba_manager import MambaManager
from cache_service.promotion import host_only, promote_hit
from cache_service.specs import DraftAttentionSpec, FullAttentionSpec, GroupSpec, MambaSpec, SlidingWindowSpec

MANAGER_BY_KIND: dict[type[GroupSpec], type] = {
    FullAttentionSpec: FullAttentionManager,
    DraftAttentionSpec: DraftAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


class GroupManagers:
    """All groups of one cache layout: admission of a hit, growth, publication, free, each as
    one loop over the managers (check first, then act: nothing fails half-way)."""

    def __init__(self, coordinator: HybridCoordinator, pools: Sequence[BlockPool], backend: PageBackend | None = None,
                 mamba_options: dict | None = None, eviction: EvictionConfig | None = None,
                 host_pages: Sequence[int] = (), host_backend: HostBackend | None = None) -> None:
        """`eviction`: the policy of every Mamba group's retained checkpoints (one object each);
        unless it is `lru`, attention blocks above every retained state of their prefix are
        evicted first (`support`, `kv_support.py`). `host_pages`: per group, the pages of its host
        tier (`host_tier.py`; none, or 0: evicted pages are dropped), copied by `host_backend`."""
        backend = backend or NullPageBackend()
        eviction = eviction or EvictionConfig()
        self.coordinator = coordinator
        self.managers = []
        groups = coordinator.layout.groups
        self.support: KvSupport | None = None
        if eviction.joint_kv and any(s.is_attention for s in groups) and not all(s.is_attention for s in groups):
            reach = coordinator.alignment if coordinator.any_group_drops else 0
            self.support = KvSupport([p for s, p in zip(groups, pools) if s.is_attention], reach)
        for g, (spec, pool) in enumerate(zip(groups, pools)):
            cls = MANAGER_BY_KIND[type(spec)]
            extra = {}
            num_host = host_pages[g] if g < len(host_pages) else 0
            if cls is MambaManager:
                extra = dict(mamba_options or {})
                extra["eviction"] = eviction.build(extra.get("page_size_bytes", 1))
                extra["support"] = self.support
            if num_host:
                policy = eviction.build(extra.get("page_size_bytes", 1)) if cls is MambaManager else None
                pool.host = HostTier(g, num_host, host_backend, policy, pool.events)
                pool.host.keeps = pool.keeps  # attention under a joint-KV policy: `support.keeps`
            self.managers.append(cls(g, spec, pool, coordinator, backend, **extra))
            if num_host and cls is MambaManager:
                self.managers[-1].attach_host()

    def of_kind(self, kind: str) -> list:
        return [m for m in self.managers if m.spec.kind == kind]

    def holds_hit(self, hashes: RequestBlockHashes, hit_tokens: int) -> bool:
        """Whether every page a hit of `hit_tokens` restores is cached now, on the device or its
        host tier (the engine admits a hit as it looks it up; a simulation that admits later
        checks first)."""
        for m in self.managers:
            cached, host = m.pool.cached, m.pool.host
            if not all(k in cached or (host is not None and k in host) for k in m.hit_keys(hashes, hit_tokens)):
                return False
        return True

    def pinned_by_hit(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[int]:
        """Per group: device pages of the hit that are free now (pinning takes them off the free queue)."""
        return [sum(1 for b in (*m.hit_blocks(hashes, hit_tokens), *m.copy_sources(hashes, hit_tokens))
                    if b is not None and b.ref_cnt == 0) for m in self.managers]

    def can_admit(self, request_id: str, hashes: RequestBlockHashes, hit_tokens: int, num_positions: int,
                  spare_pages: int = 0) -> bool:
        """Whether restoring the hit (promoting its host-only pages) and growing to
        `num_positions` fits every pool."""
        for m in self.managers:
            shared = m.hit_blocks(hashes, hit_tokens)
            pin = sum(1 for b in (*shared, *m.copy_sources(hashes, hit_tokens)) if b is not None and b.ref_cnt == 0)
            need = m.num_blocks_needed(request_id, num_positions) - len(shared)
            if isinstance(m, MambaManager):
                need = m.num_blocks_needed(request_id, num_positions) + spare_pages
            if not m.pool.can_allocate(max(0, need) + pin + len(host_only(m, hashes, hit_tokens))):
                return False
        return True

    def admit(self, request_id: str, hashes: RequestBlockHashes, hit_tokens: int,
              num_positions: int) -> tuple[int, ...]:
        """Restore the hit and take pages up to `num_positions`; returns the pages promoted from
        the host tier per group (`promotion.py`)."""
        promotion = promote_hit(self.managers, hashes, hit_tokens)
        # every hit page is pinned before any allocation may recycle free cached pages
        for m in sorted(self.managers, key=lambda m: isinstance(m, MambaManager)):
            m.restore(request_id, hashes, hit_tokens)
        promotion.release()
        for m in self.managers:
            m.grow(request_id, num_positions)
        return tuple(promotion.num_pages)

    def can_grow(self, request_id: str, num_positions: int, decoding: bool = False) -> bool:
        return all(m.pool.can_allocate(m.num_blocks_needed(request_id, num_positions, decoding))
                   for m in self.managers)

    def grow(self, request_id: str, num_positions: int, decoding: bool = False) -> None:
        for m in self.managers:
            m.grow(request_id, num_positions, decoding)

    def num_covered_positions(self, request_id: str, decoding: bool = False) -> int:
        """The most positions the request can grow to without taking a page in any group:
        an attention group's blocks cover `len(blocks) * block_size` positions; the other kinds
        (Mamba: pages per request, not per position) cover any length when they need nothing now."""
        covered = []
        for m in self.managers:
            if isinstance(m, AttentionManager):
                covered.append(len(m.req_to_blocks[request_id]) * m.block_size)
            elif m.num_blocks_needed(request_id, 0, decoding):
                return 0
        return min(covered)

    def publish(self, request_id: str, hashes: RequestBlockHashes, num_computed: Sequence[int],
                checkpoints: Sequence[int] = ()) -> list[int]:
        """Publish complete blocks; `num_computed[g]` is how far group g's content is valid."""
        return [m.publish(request_id, hashes, n, checkpoints) if not isinstance(m, MambaManager) else 0
                for m, n in zip(self.managers, num_computed)]

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def cached_keys(self) -> list[set[BlockHash]]:
        return [set(m.pool.cached) for m in self.managers]
