"""Block tables as tensors, built once per change instead of once per step.

The model reads each chunk's block table as an int64 tensor (`SeqChunk.block_table`). Building it from
the request's block list costs a tensor construction per request per step, while the list changes only
when the request grows into a new block (every `block_size` decode steps), is restored on admission or
is freed. `BlockTables` keeps the last tensor per request with the list it was built from and its
length, and rebuilds only when either differs.

Why list identity and length suffice: an attention manager gives a request a new list on `restore`
and only appends to it on `grow`; `free` drops it (and the engine drops the tensor on release). A
manager that rewrote entries in place (a sliding-window group turning dead blocks into the null
block) would need a change counter instead; the engine's groups are full and draft attention.
"""

from __future__ import annotations

import torch

from cache_service.block_pool import CacheBlock


class BlockTables:
    """Per-request block-id tensors of one attention group (`manager.req_to_blocks`)."""

    def __init__(self, manager) -> None:
        self.manager = manager  # an AttentionManager of cache_service.group_managers
        # request id -> (block list, its length, the tensor, smallest id, largest id)
        self._tables: dict[str, tuple[list[CacheBlock], int, torch.Tensor, int, int]] = {}

    def table(self, request_id: str) -> torch.Tensor:
        """int64 [num_blocks]: the request's block ids now (treat as read-only: it is reused)."""
        return self._entry(request_id)[2]

    def id_range(self, request_ids) -> tuple[int, int]:
        """(smallest, largest) block id over the tables of `request_ids`, from the lists the tensors
        were built from: a batch's range check that reads no tensor (`ForwardBatch.block_id_range`)."""
        entries = [self._entry(rid) for rid in request_ids]
        return min(e[3] for e in entries), max(e[4] for e in entries)

    def _entry(self, request_id: str) -> tuple[list[CacheBlock], int, torch.Tensor, int, int]:
        blocks = self.manager.req_to_blocks[request_id]
        entry = self._tables.get(request_id)
        if entry is not None and entry[0] is blocks and entry[1] == len(blocks):
            return entry
        ids = [b.block_id for b in blocks]
        entry = (blocks, len(blocks), torch.tensor(ids, dtype=torch.long), min(ids, default=0), max(ids, default=0))
        self._tables[request_id] = entry
        return entry

    def drop(self, request_id: str) -> None:
        """Forget the request's tensor (its blocks were given back)."""
        self._tables.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._tables)

    def check_integrity(self) -> None:
        """Raise AssertionError if a tensor that `table` would return differs from the block ids,
        or one outlives its request's blocks (used by tests after each step)."""
        for request_id, (blocks, num_blocks, table, lo, hi) in self._tables.items():
            assert request_id in self.manager.req_to_blocks, f"block table of released {request_id!r} kept"
            if self.manager.req_to_blocks[request_id] is blocks and len(blocks) == num_blocks:
                ids = self.manager.block_ids(request_id)
                assert table.tolist() == ids, f"stale block table of {request_id!r}"
                assert (lo, hi) == (min(ids, default=0), max(ids, default=0)), f"stale id range of {request_id!r}"
