"""Cache events a replica reports to the cluster-wide cache service.

Every event carries the replica-wide sequence number assigned by its `EventSink`; the index
detects a gap (a lost or reordered batch) from it and asks that replica for a full resync.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cache_service.block_hash import BlockHash


@dataclass(frozen=True)
class CacheEvent:
    seq: int
    group_id: int


@dataclass(frozen=True)
class BlockStored(CacheEvent):
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockRemoved(CacheEvent):
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared(CacheEvent):
    pass


class EventSink:
    """Collects events from all block pools of one replica, numbering them 0, 1, 2, ...

    Thread-safe: pools may be mutated from the engine thread while another thread drains."""

    def __init__(self, replica_id: str = "local", enabled: bool = True) -> None:
        self.replica_id = replica_id
        self.enabled = enabled
        self._next_seq = 0
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def _emit(self, cls: type[CacheEvent], group_id: int, *args: object) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._events.append(cls(self._next_seq, group_id, *args))  # type: ignore[call-arg]
            self._next_seq += 1

    def stored(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:
            self._emit(BlockStored, group_id, block_hashes)

    def removed(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:
            self._emit(BlockRemoved, group_id, block_hashes)

    def cleared(self, group_id: int) -> None:
        self._emit(AllBlocksCleared, group_id)

    def drain(self) -> list[CacheEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out
