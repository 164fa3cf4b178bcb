"""The engine's cache: the model's groups, each run by its per-kind manager
(`cache_service.group_managers`), over pools whose block ids are rows of the model's cache
tensors (a block table is just the ids).

    full    target attention KV blocks      (kv_block_size tokens each)
    mamba   Mamba state pages               (one page = conv + ssm state of all layers)
    draft   MTP layer attention KV blocks   (only with speculation)

Allocation is lazy: admission restores the prefix hit and takes the blocks of the first chunk;
every step takes the blocks its chunk writes (`can_grow` / `grow`). When a pool runs out the
scheduler preempts a request (`preempt`: its published prefix and a snapshot of its state stay
cached, so it resumes with a hit). A per-block hidden-state sidecar (the target's last-position
hidden, a few KB) backs lossless EAGLE: on a hit of L the draft layer's KV at L-1 is recomputed
from it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from cache_service.block_pool import BlockPool
from cache_service.checkpoint_grid import on_grid
from cache_service.coordinator import EagleMode, HitResult, HybridCoordinator
from cache_service.events import EventSink
from cache_service.eviction import EvictionConfig
from cache_service.group_managers import GroupManagers
from cache_service.hit_finders import GroupProbe
from cache_service.lifecycle import settle
from cache_service.local_cache import PoolLookup
from cache_service.miss_reasons import LookupReport, RecentlyEvicted, classify_miss
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.specs import CacheLayout, DraftAttentionSpec, FullAttentionSpec, MambaSpec
from workers.engine.block_tables import BlockTables
from workers.engine.cache_stats import checkpoint_stats, host_stats
from workers.engine.config import EngineConfig
from workers.engine.host_pages import HostPages
from workers.engine.page_backend import ModelPageBackend, plan_checkpoints
from workers.engine.request import Request


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
        state_page_bytes: int = 1,
        num_host_kv_blocks: int = 0,
        num_host_state_pages: int = 0,
    ) -> None:
        """`num_host_kv_blocks` / `num_host_state_pages`: the host tier's pages (`host_pages.py`;
        0: none) for each KV group (target and draft) and for the Mamba group."""
        self.config = config
        self.caches = caches
        self.speculative = speculative
        self.num_spec_tokens = config.num_spec_tokens if speculative else 0
        groups = [FullAttentionSpec(config.kv_block_size), MambaSpec(config.mamba_block_size)]
        if speculative:
            groups.append(DraftAttentionSpec(config.kv_block_size))
        # states on the attention grid (config.checkpoint_grid): mamba_block_size bounds the spacing
        self.layout, spacing = on_grid(CacheLayout(tuple(groups)), config.checkpoint_grid)
        groups = list(self.layout.groups)
        eagle = config.eagle_mode if speculative else EagleMode.OFF
        self.coordinator = HybridCoordinator(self.layout, eagle, drop_rule=config.drop_rule)
        self.planner = CheckpointPlanner(self.coordinator, make_retention(
            config.retention, self.layout.alignment, state_bytes=state_page_bytes, spacing=spacing))
        self.events = events if events is not None else EventSink(enabled=False)  # no consumer: keep nothing
        sizes = {"full": num_kv_blocks, "mamba": num_state_slots, "draft": num_kv_blocks}
        self.pools = [BlockPool(sizes[spec.kind], g, self.events) for g, spec in enumerate(groups)]
        # the states evicted lately: what tells a `state_evicted` miss from a `state_not_retained` one
        self.evicted = RecentlyEvicted(self.layout, capacity=4 * num_state_slots)
        self.events.taps.append(self.evicted)
        budget = int(config.cache_memory_bytes * config.checkpoint_memory_fraction) // max(1, state_page_bytes)
        # [blocks, hidden] target h at block end - 1, beside the KV it belongs to (config.device)
        self.sidecar = torch.zeros(num_kv_blocks, hidden_size, device=config.device)
        # only lossless EAGLE reads it (a hit's draft KV at L-1 is recomputed from it): without speculation,
        # or with the drop rule, recording it is a copy per completed block for nothing
        self.keeps_sidecar = eagle is EagleMode.LOSSLESS
        host = {"full": num_host_kv_blocks, "mamba": num_host_state_pages, "draft": num_host_kv_blocks}
        host_pages = tuple(host[spec.kind] for spec in groups)
        self.host_pages = (HostPages(caches, self.layout, host_pages, self.sidecar if self.keeps_sidecar else None)
                           if any(host_pages) else None)
        self.groups = GroupManagers(self.coordinator, self.pools, ModelPageBackend(caches, self.layout), {
            "num_verify_pages": self.num_spec_tokens + 1 if speculative else 0,
            "max_retained_pages": budget, "page_size_bytes": state_page_bytes}, EvictionConfig(config.eviction),
            host_pages=host_pages, host_backend=self.host_pages)
        (self.full,) = self.groups.of_kind("full")
        (self.mamba,) = self.groups.of_kind("mamba")
        self.draft = self.groups.of_kind("draft")[0] if speculative else None
        self.block_tables = BlockTables(self.full)
        self.draft_tables = BlockTables(self.draft) if speculative else None
        # positions each running request's pages cover, decode pages included (taken at its first
        # decode): a step within them takes nothing, so can_grow / grow return at once
        self._covered: dict[str, int] = {}
        self.lookup_view = PoolLookup(self.pools)
        # per group: whether its content runs to num_draft_computed_tokens (else num_computed_tokens)
        self._is_draft = tuple(spec.kind == "draft" for spec in self.layout.groups)
        self._alignment = self.layout.alignment  # an lcm over the groups: computed once, read per request

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def block_size(self) -> int:
        return self.config.kv_block_size

    @property
    def num_free_kv_blocks(self) -> int:
        return self.full.pool.num_free_blocks

    @property
    def num_empty_kv_blocks(self) -> int:
        """Free attention blocks that hold no cached page (taking one evicts nothing)."""
        return self.full.pool.num_free_empty_blocks

    # ---- sizing ---------------------------------------------------------------------------
    def max_positions(self, req: Request) -> int:
        return req.num_prompt_tokens + req.params.max_tokens + self.num_spec_tokens

    def fits_at_all(self, req: Request) -> bool:
        """Whether the request could run alone in an empty cache (else it is refused up front)."""
        blocks = -(-self.max_positions(req) // self.block_size)
        pages = 1 + self.mamba.num_decode_pages + 1  # + room for a snapshot
        return blocks < self.full.pool.num_blocks and pages < self.mamba.pool.num_blocks

    def positions_for(self, req: Request, num_new_tokens: int) -> int:
        """How many positions a step computing `num_new_tokens` writes KV for (the draft layer
        runs k - 1 positions past the last verified token)."""
        return req.num_computed_tokens + num_new_tokens + self.num_spec_tokens

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, req: Request) -> HitResult:
        return self._probe(req)[0]

    def _probe(self, req: Request) -> tuple[HitResult, list[GroupProbe]]:
        """The reconciled hit and the probes that found it (they read the pools live)."""
        if not self.config.enable_prefix_caching:
            return HitResult(0, tuple(0 for _ in self.layout.groups), 0, (0,)), []
        probes = self.coordinator.probes(req.hashes.hashes, req.num_prefill_tokens, self.lookup_view)
        return self.coordinator.reconcile(probes), probes

    def try_admit(self, req: Request, first_chunk: int | None = None, kv_only: bool = False) -> bool:
        """Look up the prefix hit and, if the pools have room for it and for up to `first_chunk`
        tokens past it (the scheduler's budget; default 1), restore it (KV blocks shared, Mamba
        state copied into the working page). Lazy: later chunks and decodes grow it. The first
        admission also reports the lookup (`req.cache_report`, with its miss reason). `kv_only`:
        share the attention groups' blocks as far as they all serve, with or without a Mamba state
        there (a hand-off's import brings its own working state: `handoff_import.py`)."""
        hit, probes = self._probe(req)
        length = hit.hit_tokens
        if kv_only and probes:
            top = probes[0].ctx.floor(probes[0].ctx.cap)
            length = max(length, min((p.longest_servable(top) for p in probes if p.spec.is_attention), default=0))
        chunk = min(first_chunk or 1, req.num_prefill_tokens - length)
        positions = length + chunk + self.num_spec_tokens
        rid = req.request_id
        if not self.groups.can_admit(rid, req.hashes, length, positions, spare_pages=1):  # +1: a snapshot
            return False
        if not req.num_preemptions:  # classified before admitting: taking pages may evict what the probes read
            self.planner.observe(hit.attention_match_tokens)
            reason = classify_miss(self.coordinator, probes, hit, self.evicted)
            req.cache_report = LookupReport.of(req.num_prompt_tokens, hit, probes, reason)
        start = time.perf_counter()
        promoted = self.groups.admit(rid, req.hashes, length, positions)
        if any(promoted):  # what a host hit costs here (the router's price: host_copy_price.py)
            self.host_pages.observe_promotion(promoted, time.perf_counter() - start)
        self._covered.pop(rid, None)
        req.num_restored_tokens = req.num_computed_tokens = length
        if not req.num_preemptions:
            req.num_cached_tokens = length
            req.num_host_cached_tokens = length if any(promoted) else 0
            if any(promoted):
                req.cache_report = replace(req.cache_report, host_promoted_pages=promoted)
        draft_start = length if self.config.eagle_mode is EagleMode.DROP or not length else length - 1
        req.num_draft_computed_tokens = draft_start
        req.junctions = self.coordinator.junctions(hit)
        req.checkpoints, req.periodic_checkpoints = plan_checkpoints(self.planner, req)
        return True

    def hit_sidecar(self, req: Request) -> torch.Tensor:
        """Target hidden state at position num_restored_tokens - 1 (lossless EAGLE)."""
        block = self.full.req_to_blocks[req.request_id][req.num_restored_tokens // self.block_size - 1]
        return self.sidecar[block.block_id]

    # ---- growth ---------------------------------------------------------------------------
    def can_grow(self, req: Request, num_new_tokens: int, decoding: bool) -> bool:
        positions = self.positions_for(req, num_new_tokens)
        if positions <= self._covered.get(req.request_id, 0):
            return True
        return self.groups.can_grow(req.request_id, positions, decoding)

    def grow(self, req: Request, num_new_tokens: int, decoding: bool) -> None:
        rid, positions = req.request_id, self.positions_for(req, num_new_tokens)
        if positions <= self._covered.get(rid, 0):
            return
        self.groups.grow(rid, positions, decoding)
        # counted as a decode would (a prefill's cover is 0 until its decode pages are taken), so a
        # cover read from here is valid for both kinds of step
        self._covered[rid] = self.groups.num_covered_positions(rid, decoding=True)

    def block_table(self, req: Request) -> torch.Tensor:
        """int64 [num_blocks] target KV block ids (reused across steps while unchanged: read-only)."""
        return self.block_tables.table(req.request_id)

    def draft_table(self, req: Request) -> torch.Tensor:
        """int64 [num_blocks] draft KV block ids (reused across steps while unchanged: read-only)."""
        return self.draft_tables.table(req.request_id)

    def state_page(self, req: Request) -> int:
        return self.mamba.working_page(req.request_id)

    def verify_pages(self, req: Request, num: int) -> tuple[int, ...]:
        return self.mamba.verify_pages(req.request_id, num)

    # ---- publication ----------------------------------------------------------------------
    def record_hidden(self, req: Request, start: int, hidden: torch.Tensor, first_row: int = 0,
                      num_rows: int | None = None) -> None:
        """Keep the sidecar rows of blocks whose last position lies in [start, start + num_rows);
        position start + j's hidden state is hidden[first_row + j] (num_rows: all rows from first_row).
        A no-op unless the engine drafts losslessly (the only reader)."""
        if not self.keeps_sidecar:
            return
        size = self.block_size
        if num_rows is None:
            num_rows = hidden.shape[0] - first_row
        first = -(-(start + 1) // size)  # first block end >= start + 1
        ends = range(first * size, start + num_rows + 1, size)
        if not ends:  # most decode steps complete no block
            return
        blocks = self.full.req_to_blocks[req.request_id]
        for end in ends:
            self.sidecar[blocks[end // size - 1].block_id] = hidden[first_row + end - 1 - start]

    def publish(self, req: Request) -> None:
        """After a step: publish every newly completed block of every group under its prefix hash."""
        self._settle(req)

    def snapshot(self, req: Request, page: int, position: int) -> bool:
        """Retain the Mamba state in `page` (the state after `position` tokens) as a checkpoint."""
        if not self.config.enable_prefix_caching:
            return False
        return self.mamba.snapshot(req.hashes, page, position, position in req.periodic_checkpoints)

    def preempt(self, req: Request) -> None:
        """Give back everything `req` holds, keeping what lets it resume with a hit: its
        published blocks, a snapshot of its state where it stopped (when aligned) and the
        boundary states retention keeps."""
        self._settle(req, working_state_at=req.num_computed_tokens, keep_final=True, free=True)

    def retire(self, req: Request, keep: bool = True) -> None:
        """`req` ended: with `keep` (not aborted) publish its blocks and keep the boundary states
        retention keeps (the final boundary and, in drop mode, one unit below: the next chat
        turn's hit); then give back everything it holds."""
        self._settle(req, publish=keep, keep_final=keep, free=True)

    def _settle(self, req: Request, *, publish: bool = True, working_state_at: int | None = None,
                keep_final: bool = False, free: bool = False) -> None:
        """`lifecycle.settle` (publish -> snapshot -> keep -> free, the simulations' order too)."""
        rid = req.request_id
        if self.config.enable_prefix_caching:
            computed = [req.num_draft_computed_tokens if draft else req.num_computed_tokens for draft in self._is_draft]
            keep = (set(self.planner.checkpoints(req.num_prompt_tokens, req.num_computed_tokens, req.junctions))
                    if keep_final else ())
            settle(self.groups, rid, req.hashes, computed, req.checkpoints, publish=publish,
                   working_state_at=working_state_at, keep=keep, free=free)
        elif free:
            self.groups.free(rid)
        if free:
            self._covered.pop(rid, None)
            self.block_tables.drop(rid)
            if self.draft_tables is not None:
                self.draft_tables.drop(rid)

    def holds(self, req: Request) -> bool:
        return self.mamba.holds(req.request_id)

    def stats(self) -> dict[str, int]:
        """Retained checkpoint gauges and counters (engine stats, /metrics)."""
        return {**checkpoint_stats(self.mamba), **self.host_stats()}

    def host_stats(self) -> dict[str, int]:
        """The host tier's pages held, copied each way and dropped, over every group (zeros without one)."""
        return host_stats(self.pools)

    def check_integrity(self) -> None:
        """Raise AssertionError if a pool invariant is broken, a request's remembered cover
        exceeds what its pages cover now, or a kept block table is stale (tests, after each step)."""
        for pool in self.pools:
            pool.check_integrity()
        for rid, covered in self._covered.items():
            assert self.mamba.holds(rid), f"cover of released {rid!r} kept"
            assert covered <= self.groups.num_covered_positions(rid, decoding=True), f"cover of {rid!r} overstated"
        for tables in (self.block_tables, self.draft_tables):
            if tables is not None:
                tables.check_integrity()
