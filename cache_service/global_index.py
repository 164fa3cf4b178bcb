"""The cluster-wide index: which replica holds which block hashes and Mamba snapshots, per group.

Fed by replica events (`events.py`). Each replica's events must arrive with consecutive
sequence numbers; a gap (lost or reordered batch) marks the replica stale until it sends a full
resync, and its entries are ignored for routing meanwhile. A dead replica is purged.

Storage: per group, `hash -> bitmask of replicas`, so one index serves any number of replica
views and a lookup is a dict probe plus a bit test. `ReplicaView` is the `CacheLookup` the
coordinator sees for one replica: the same hit semantics as on the worker itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache_service.block_hash import BlockHash
from cache_service.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent


@dataclass
class ReplicaState:
    replica_id: str
    bit: int
    next_seq: int = 0
    stale: bool = False  # a gap was seen; waiting for a resync
    num_entries: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ApplyResult:
    num_applied: int
    needs_resync: bool


class GlobalIndex:
    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self._holders: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.replicas: dict[str, ReplicaState] = {}
        self._free_bits: list[int] = []
        self._lock = threading.RLock()

    # ---- membership -----------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> ReplicaState:
        with self._lock:
            if replica_id in self.replicas:
                return self.replicas[replica_id]
            bit = self._free_bits.pop() if self._free_bits else len(self.replicas) + len(self._free_bits)
            while any(r.bit == bit for r in self.replicas.values()):
                bit += 1
            state = ReplicaState(replica_id, bit, num_entries=[0] * self.num_groups)
            self.replicas[replica_id] = state
            return state

    def purge(self, replica_id: str) -> int:
        """Forget a replica (dead or leaving). Returns the number of entries removed."""
        with self._lock:
            state = self.replicas.pop(replica_id, None)
            if state is None:
                return 0
            removed = self._clear_bits(state)
            self._free_bits.append(state.bit)
            return removed

    def _clear_bits(self, state: ReplicaState) -> int:
        removed = sum(_clear_group(holders, 1 << state.bit) for holders in self._holders)
        state.num_entries = [0] * self.num_groups
        return removed

    # ---- events ---------------------------------------------------------------------------
    def apply(self, replica_id: str, events: Sequence[CacheEvent]) -> ApplyResult:
        """Apply one batch of a replica's events, in order. A sequence gap marks the replica
        stale (ignored for routing) and asks for a resync; nothing from the batch is applied."""
        with self._lock:
            state = self.replicas.get(replica_id) or self.add_replica(replica_id)
            if state.stale:
                return ApplyResult(0, True)
            for offset, event in enumerate(events):
                if event.seq != state.next_seq + offset:
                    state.stale = True
                    return ApplyResult(0, True)
            mask = 1 << state.bit
            for event in events:
                holders = self._holders[event.group_id]
                if isinstance(event, BlockStored):
                    for key in event.block_hashes:
                        old = holders.get(key, 0)
                        if not old & mask:
                            state.num_entries[event.group_id] += 1
                        holders[key] = old | mask
                elif isinstance(event, BlockRemoved):
                    for key in event.block_hashes:
                        old = holders.get(key, 0)
                        if old & mask:
                            state.num_entries[event.group_id] -= 1
                            if old & ~mask:
                                holders[key] = old & ~mask
                            else:
                                del holders[key]
                elif isinstance(event, AllBlocksCleared):
                    _clear_group(holders, mask)
                    state.num_entries[event.group_id] = 0
            state.next_seq += len(events)
            return ApplyResult(len(events), False)

    def resync(self, replica_id: str, contents: Sequence[Iterable[BlockHash]], next_seq: int) -> None:
        """Replace a replica's entries with a full snapshot taken when its next event is `next_seq`."""
        with self._lock:
            state = self.replicas.get(replica_id) or self.add_replica(replica_id)
            self._clear_bits(state)
            mask = 1 << state.bit
            for group, keys in enumerate(contents):
                holders = self._holders[group]
                count = 0
                for key in keys:
                    holders[key] = holders.get(key, 0) | mask
                    count += 1
                state.num_entries[group] = count
            state.next_seq = next_seq
            state.stale = False

    # ---- lookups --------------------------------------------------------------------------
    def view(self, replica_id: str) -> ReplicaView:
        return ReplicaView(self, self.replicas[replica_id].bit)

    def routable_replicas(self) -> list[str]:
        return [r for r, s in self.replicas.items() if not s.stale]

    @property
    def num_entries(self) -> int:
        return sum(len(h) for h in self._holders)


def _clear_group(holders: dict[BlockHash, int], mask: int) -> int:
    """Remove one replica's bit from every entry of a group; returns how many it held."""
    keys = [k for k, v in holders.items() if v & mask]
    for key in keys:
        value = holders[key] & ~mask
        if value:
            holders[key] = value
        else:
            del holders[key]
    return len(keys)


class ReplicaView:
    """`CacheLookup` over one replica's entries in the global index (read-only)."""

    __slots__ = ("_holders", "_mask")

    def __init__(self, index: GlobalIndex, bit: int) -> None:
        self._holders = index._holders
        self._mask = 1 << bit

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        return bool(self._holders[group_id].get(block_hash, 0) & self._mask)
