"""What a request leaves behind after a chunk and when it ends, in one order for every caller.

    admit     GroupManagers.admit: restore the hit (share its blocks, copy its Mamba state),
              take the first chunk's pages
    grow      GroupManagers.grow: the next chunk's pages (evicting LRU blocks; Mamba: by value)
    settle    after a chunk's forward, and when the request stops:
      publish   each attention group's newly complete blocks (sliding window: the window tails
                retention keeps)
      snapshot  the working Mamba state at `working_state_at` (a checkpoint the chunk ended on,
                or where a preempted request stopped)
      keep      the decode-boundary states at the positions in `keep` (retention's final
                boundary, and one unit below it in drop mode: the next chat turn's hit)
      free      every page back, tail first (cached ones stay cached): finished, aborted, preempted

Callers: the engine's cache manager (`workers/engine/cache_manager.py`: after each step, on
preemption, when a request ends) and `prefill.run_prefill` (every simulation).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from cache_service.block_hash import RequestBlockHashes
from cache_service.group_managers import GroupManagers
from cache_service.mamba_manager import MambaManager


def settle(groups: GroupManagers, request_id: str, hashes: RequestBlockHashes, num_computed: Sequence[int],
           checkpoints: Sequence[int] = (), *, publish: bool = True, working_state_at: int | None = None,
           keep: Collection[int] = (), free: bool = False, periodic: Collection[int] = ()) -> list[int]:
    """publish -> snapshot -> keep -> free; `num_computed[g]`: how far group g's content is valid;
    `periodic`: the checkpoints that are retention grid positions only (`CheckpointPlanner.periodic`).
    Returns per group the blocks newly cached (Mamba: the snapshots taken)."""
    stored = groups.publish(request_id, hashes, num_computed, checkpoints) if publish else [0] * len(num_computed)
    for g, manager in enumerate(groups.managers):
        if not isinstance(manager, MambaManager):
            continue
        if working_state_at is not None:
            stored[g] += manager.snapshot(hashes, manager.working_page(request_id), working_state_at,
                                          working_state_at in periodic)
        for position, page in manager.boundary_states(request_id):
            if position in keep:
                stored[g] += manager.snapshot(hashes, page, position)
    if free:
        groups.free(request_id)
    return stored
