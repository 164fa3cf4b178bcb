"""What the engine's cache manager hands the shared cache core: page copies on the model's tensors
(`ModelPageBackend`, the group managers' `PageBackend`), and the snapshot positions of a request
the core's planner gives (`plan_checkpoints`)."""

from __future__ import annotations

from cache_service.retention import CheckpointPlanner
from cache_service.specs import CacheLayout
from workers.engine.request import Request


class ModelPageBackend:
    """Copies pages of the model's cache tensors (through `ModelCaches`, so every TP rank copies)."""

    def __init__(self, caches, layout: CacheLayout) -> None:
        self.caches, self.layout = caches, layout

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        kind = self.layout.groups[group_id].kind
        if kind == "mamba":
            self.caches.copy_state(src, dst)
            return
        pools = self.caches.draft_kv if kind == "draft" else self.caches.kv
        for k_cache, v_cache in pools.values():
            k_cache[dst].copy_(k_cache[src])
            v_cache[dst].copy_(v_cache[src])


def plan_checkpoints(planner: CheckpointPlanner, req: Request) -> tuple[tuple[int, ...], frozenset[int]]:
    """(every snapshot position, the grid-only ones) of `req` just admitted: its prompt's plan and,
    resuming after a preemption, the plan of what it had computed (prompt + output) too. A grid
    position only counts as grid when no plan needs it (eviction ranks those below boundaries)."""
    plans = [(req.num_prompt_tokens, req.num_prompt_tokens)]
    if req.num_prefill_tokens > req.num_prompt_tokens:  # resuming after a preemption
        plans.append((req.num_prefill_tokens, req.num_prefill_tokens))
    marks, grid, needed = set(), set(), set()
    for n, computed in plans:
        positions, periodic = planner.checkpoints(n, computed, req.junctions), planner.periodic(
            n, computed, req.junctions)
        marks.update(positions)
        grid.update(periodic)
        needed.update(set(positions) - periodic)
    return tuple(sorted(marks)), frozenset(grid - needed)
