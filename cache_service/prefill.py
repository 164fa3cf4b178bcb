"""A whole prefill through the group managers in one call: how every simulation publishes.

The engine runs a request's prefill chunk by chunk through the per-kind group managers
(`group_managers.py`, `mamba_manager.py`); the simulations have no model, so they make the same
calls on the same managers in one go, with a null page backend:

    admit     restore the hit (share its blocks, copy its Mamba state)
    per chunk (ending at each checkpoint past the hit, then at N):
      grow      take the chunk's pages (evicting LRU blocks; Mamba: by expected value)
      settle    `lifecycle.settle`, as the engine's cache manager calls it: publish each
                attention group's complete blocks, snapshot the Mamba state when the chunk ends
                at a checkpoint; after the last chunk, free every page (tail first)

Callers: `simulate.py` (and so `hybridserve explain`), `LocalPrefixCache.store_prefix` (property
tests, benchmarks) and the trace simulator's replicas (`trace_sim/replica.py`). None of them
walks block ends or caches a block itself, so publication exists once, in the managers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from cache_service.block_hash import RequestBlockHashes
from cache_service.group_managers import GroupManagers
from cache_service.lifecycle import settle


class StoreResult(NamedTuple):
    admitted: bool  # False: the pools could not hold the whole prompt at once; nothing was stored
    num_stored_blocks: tuple[int, ...]  # per group: blocks newly cached (Mamba: snapshots taken)
    num_promoted_pages: tuple[int, ...] = ()  # per group: pages of the hit copied back from the host tier


def run_prefill(groups: GroupManagers, request_id: str, hashes: RequestBlockHashes, hit_tokens: int,
                num_tokens: int, checkpoints: Sequence[int], periodic: Collection[int] = ()) -> StoreResult:
    """Prefill [hit_tokens, num_tokens) of a request and publish what it leaves behind, in the
    engine's order: chunks end at each checkpoint past the hit and at the prompt's end; each
    chunk grows every group, publishes its complete blocks, then snapshots the Mamba state if
    it ends at a checkpoint (the engine's further cuts at `chunk_size` are not modelled). The
    pages of the hit must be cached (`GroupManagers.holds_hit`). Needs room for every page of
    the prompt plus one spare Mamba page for a snapshot, as the engine's admission asks;
    without it nothing is stored (the engine would wait or preempt)."""
    if not groups.can_admit(request_id, hashes, hit_tokens, num_tokens, spare_pages=1):
        return StoreResult(False, (0,) * len(groups.managers), (0,) * len(groups.managers))
    marks = set(checkpoints)
    stops = sorted({c for c in marks if hit_tokens < c < num_tokens} | {num_tokens})
    promoted = groups.admit(request_id, hashes, hit_tokens, stops[0])
    stored = [0] * len(groups.managers)
    for end in stops:
        groups.grow(request_id, end)
        now = settle(groups, request_id, hashes, [end] * len(groups.managers), checkpoints,
                     working_state_at=end if end in marks else None, free=end == num_tokens, periodic=periodic)
        stored = [a + b for a, b in zip(stored, now)]
    return StoreResult(True, tuple(stored), promoted)
