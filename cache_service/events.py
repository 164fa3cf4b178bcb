"""Cache events a replica reports to the cluster-wide cache service.

Every event carries the replica-wide sequence number assigned by its `EventSink`; the index
detects a gap (a lost or reordered batch) from it and asks that replica for a full resync.
On the wire (`messages.EventBatchMsg`) a batch is packed: the events for one block of every
group become one `BlockRecord` with a bitmask of groups (`pack_events`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from cache_service.block_hash import BlockHash
from cache_service.messages import BlockRecord, RecordKind


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


@dataclass(frozen=True)
class HostBlockStored(CacheEvent):
    """Pages demoted to the host tier (the device's `BlockRemoved` for them comes beside it)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class HostBlockRemoved(CacheEvent):
    block_hashes: tuple[BlockHash, ...]


class EventSink:
    """Collects events from all block pools of one replica, numbering them 0, 1, 2, ...

    Thread-safe: pools may be mutated from the engine thread while another thread drains.
    `taps`: callables(group_id, block_hashes) told of every removal, enabled or not, on the
    mutating thread (`miss_reasons.RecentlyEvicted`)."""

    def __init__(self, replica_id: str = "local", enabled: bool = True) -> None:
        self.replica_id = replica_id
        self.enabled = enabled
        self._next_seq = 0
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()
        self.taps: list[Callable[[int, tuple[BlockHash, ...]], None]] = []

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
            for tap in self.taps:
                tap(group_id, block_hashes)
            self._emit(BlockRemoved, group_id, block_hashes)

    def cleared(self, group_id: int) -> None:
        """Every page of the group is gone, on the device and its host tier."""
        self._emit(AllBlocksCleared, group_id)

    def host_stored(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:
            self._emit(HostBlockStored, group_id, block_hashes)

    def host_removed(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if block_hashes:
            self._emit(HostBlockRemoved, group_id, block_hashes)

    def drain(self) -> list[CacheEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def take_batch(self) -> tuple[int, int, tuple[BlockRecord, ...]]:
        """(first seq, end seq, packed records) of every event not yet taken."""
        with self._lock:
            events, self._events, end = self._events, [], self._next_seq
        return (events[0].seq if events else end), end, pack_events(events)


_KIND = {BlockStored: RecordKind.STORED, BlockRemoved: RecordKind.REMOVED, AllBlocksCleared: RecordKind.CLEARED,
         HostBlockStored: RecordKind.HOST_STORED, HostBlockRemoved: RecordKind.HOST_REMOVED}


def pack_events(events: list[CacheEvent]) -> tuple[BlockRecord, ...]:
    """One record per (kind, block) for all groups, order-preserving per block.

    A group's event for a block merges into that block's latest record when the kind matches:
    nothing about that block happened in between, and other blocks are independent. A clear is
    a barrier (it touches every block of its group): nothing merges across it."""
    kinds: list[RecordKind] = []
    keys: list[BlockHash | None] = []
    masks: list[int] = []
    latest: dict[BlockHash, int] = {}
    for event in events:
        kind, bit = _KIND[type(event)], 1 << event.group_id
        if kind is RecordKind.CLEARED:
            if kinds and kinds[-1] is RecordKind.CLEARED:
                masks[-1] |= bit
            else:
                kinds.append(kind)
                keys.append(None)
                masks.append(bit)
            latest.clear()
            continue
        for key in event.block_hashes:
            at = latest.get(key)
            if at is not None and kinds[at] is kind and not masks[at] & bit:
                masks[at] |= bit
            else:
                latest[key] = len(kinds)
                kinds.append(kind)
                keys.append(key)
                masks.append(bit)
    return tuple(BlockRecord(k, key, m) for k, key, m in zip(kinds, keys, masks))
