"""The one small interface every hit finder asks: "is this prefix cached for group g?".

The same coordinator code runs against a worker's local block pools and against the global
index's view of one replica; both implement `CacheLookup`.

For attention groups the key is the block hash of the prefix ending at that block's last token;
for Mamba groups it is the hash of the prefix at which the state snapshot was taken.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from cache_service.block_hash import BlockHash


class CacheLookup(Protocol):
    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        """True iff group `group_id` holds the block (or state snapshot) named by `block_hash`.
        Must not mutate anything (no LRU touch): lookups are also used for routing estimates."""
        ...


class SetLookup:
    """A lookup over plain per-group sets of hashes (tests, simulations, index snapshots)."""

    def __init__(self, cached: Sequence[Collection[BlockHash]]) -> None:
        self.cached = cached

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        return block_hash in self.cached[group_id]
