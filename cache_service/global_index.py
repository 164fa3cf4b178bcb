"""The cluster-wide index: which replica holds which block hashes and Mamba snapshots, per group.

Fed by batches of replica events pushed once per engine step (`messages.EventBatchMsg`). Each
replica's batches must arrive with contiguous sequence ranges; a gap (a lost or reordered
batch) marks the replica stale until it sends a chunked resync, and its entries are ignored for
routing meanwhile (it is still routed by load). A dead replica is purged.

Storage: per group, `hash -> bitmask of replicas`, so one index serves any number of replicas:
`scorer.AllReplicaScorer` scores all of them in one walk of a request's chain, and
`ReplicaView` is the `CacheLookup` the coordinator sees for one replica (the same hit
semantics as on the worker itself).

Two tiers: `holders` are pages on a replica's device, `host_holders` pages on its host tier
(`host_tier.py`: a hit there is served after a host-to-device copy). A page can be in both. The
router scores the device alone and both tiers together (`tiers_view`), and prices the difference
as copies (`router.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache_service.block_hash import BlockHash
from cache_service.events import CacheEvent, pack_events
from cache_service.messages import BlockRecord, RecordKind


@dataclass
class ReplicaState:
    replica_id: str
    bit: int
    next_seq: int = 0
    stale: bool = True  # no consistent view yet (new, a gap, or a resync in progress)
    resync_id: str | None = None  # the chunked resync in progress
    num_entries: list[int] = field(default_factory=list)
    num_host_entries: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ApplyResult:
    num_applied: int
    needs_resync: bool


class GlobalIndex:
    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.holders: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.host_holders: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.replicas: dict[str, ReplicaState] = {}
        self.by_bit: dict[int, str] = {}
        self._routable: int | None = None  # cached bitmask of non-stale replicas (None: recompute)
        self._lock = threading.RLock()

    # ---- membership -----------------------------------------------------------------------
    def add_replica(self, replica_id: str, stale: bool = False) -> ReplicaState:
        with self._lock:
            if replica_id in self.replicas:
                return self.replicas[replica_id]
            bit = next(b for b in range(len(self.by_bit) + 1) if b not in self.by_bit)
            state = ReplicaState(replica_id, bit, stale=stale, num_entries=[0] * self.num_groups,
                                 num_host_entries=[0] * self.num_groups)
            self.replicas[replica_id] = state
            self.by_bit[bit] = replica_id
            self._routable = None
            return state

    def purge(self, replica_id: str) -> int:
        """Forget a replica (dead or leaving). Returns the number of entries removed."""
        with self._lock:
            state = self.replicas.pop(replica_id, None)
            if state is None:
                return 0
            removed = self._clear_bits(state)
            del self.by_bit[state.bit]
            self._routable = None
            return removed

    def _clear_bits(self, state: ReplicaState) -> int:
        removed = sum(_clear_group(holders, 1 << state.bit) for holders in (*self.holders, *self.host_holders))
        state.num_entries = [0] * self.num_groups
        state.num_host_entries = [0] * self.num_groups
        return removed

    # ---- events ---------------------------------------------------------------------------
    def apply_batch(self, replica_id: str, first_seq: int, end_seq: int,
                    records: Sequence[BlockRecord]) -> ApplyResult:
        """Apply one pushed batch covering events [first_seq, end_seq). A batch wholly below the
        expected seq is old (already in a resync snapshot) and skipped; a gap marks the replica
        stale and asks for a resync; nothing from such a batch is applied."""
        with self._lock:
            state = self.replicas.get(replica_id) or self.add_replica(replica_id)
            if state.stale:
                return ApplyResult(0, True)
            if end_seq <= state.next_seq:
                return ApplyResult(0, False)
            if first_seq != state.next_seq:
                state.stale, self._routable = True, None
                return ApplyResult(0, True)
            mask = 1 << state.bit
            for rec in records:
                groups, kind = rec.group_mask, rec.kind
                if kind is RecordKind.CLEARED:
                    for g in range(self.num_groups):
                        if groups >> g & 1:
                            _clear_group(self.holders[g], mask)
                            _clear_group(self.host_holders[g], mask)
                            state.num_entries[g] = state.num_host_entries[g] = 0
                    continue
                host = kind is RecordKind.HOST_STORED or kind is RecordKind.HOST_REMOVED
                tier = self.host_holders if host else self.holders
                counts = state.num_host_entries if host else state.num_entries
                key, stored = rec.block_hash, kind is RecordKind.STORED or kind is RecordKind.HOST_STORED
                g = 0
                while groups:
                    if groups & 1:
                        holders = tier[g]
                        old = holders.get(key, 0)
                        if stored and not old & mask:
                            holders[key] = old | mask
                            counts[g] += 1
                        elif not stored and old & mask:
                            counts[g] -= 1
                            if old & ~mask:
                                holders[key] = old & ~mask
                            else:
                                del holders[key]
                    groups >>= 1
                    g += 1
            state.next_seq = end_seq
            return ApplyResult(len(records), False)

    def apply(self, replica_id: str, events: Sequence[CacheEvent]) -> ApplyResult:
        """Apply per-group events (consecutive seqs) as one batch."""
        if not events:
            return ApplyResult(0, self.replicas.get(replica_id, self.add_replica(replica_id)).stale)
        for offset, event in enumerate(events):
            if event.seq != events[0].seq + offset:  # reordered inside the batch: a gap
                with self._lock:
                    (self.replicas.get(replica_id) or self.add_replica(replica_id)).stale = True
                    self._routable = None
                return ApplyResult(0, True)
        return self.apply_batch(replica_id, events[0].seq, events[-1].seq + 1, pack_events(events))

    # ---- chunked resync -------------------------------------------------------------------
    def begin_resync(self, replica_id: str, resync_id: str) -> None:
        """Clear the replica's entries; it is routed by load only until `end_resync`."""
        with self._lock:
            state = self.replicas.get(replica_id) or self.add_replica(replica_id)
            self._clear_bits(state)
            state.stale, state.resync_id, self._routable = True, resync_id, None

    def resync_chunk(self, replica_id: str, resync_id: str, group_id: int, keys: Iterable[BlockHash],
                     host: bool = False) -> bool:
        """Add one chunk (`host`: of the replica's host tier); False if no such resync is in
        progress (e.g. the service restarted)."""
        with self._lock:
            state = self.replicas.get(replica_id)
            if state is None or state.resync_id != resync_id:
                return False
            mask, holders, added = 1 << state.bit, (self.host_holders if host else self.holders)[group_id], 0
            for key in keys:
                old = holders.get(key, 0)
                if not old & mask:
                    holders[key] = old | mask
                    added += 1
            (state.num_host_entries if host else state.num_entries)[group_id] += added
            return True

    def end_resync(self, replica_id: str, resync_id: str, next_seq: int) -> bool:
        with self._lock:
            state = self.replicas.get(replica_id)
            if state is None or state.resync_id != resync_id:
                return False
            state.next_seq, state.stale, state.resync_id, self._routable = next_seq, False, None, None
            return True

    def resync(self, replica_id: str, contents: Sequence[Iterable[BlockHash]], next_seq: int,
               host_contents: Sequence[Iterable[BlockHash]] = ()) -> None:
        """Replace a replica's entries with a full snapshot taken when its next event is `next_seq`
        (`host_contents`: per group, its host tier's keys)."""
        with self._lock:
            self.begin_resync(replica_id, "whole")
            for group, keys in enumerate(contents):
                self.resync_chunk(replica_id, "whole", group, keys)
            for group, keys in enumerate(host_contents):
                self.resync_chunk(replica_id, "whole", group, keys, host=True)
            self.end_resync(replica_id, "whole", next_seq)

    # ---- lookups --------------------------------------------------------------------------
    def view(self, replica_id: str, tiers: bool = False) -> ReplicaView:
        return ReplicaView(self, self.replicas[replica_id].bit, tiers)

    def routable_replicas(self) -> list[str]:
        return [r for r, s in self.replicas.items() if not s.stale]

    def mask_of(self, replica_ids: Iterable[str]) -> int:
        """The bits of those of `replica_ids` whose entries can be trusted (known, not stale)."""
        routable = self.routable_mask()
        if replica_ids is self.replicas.keys() or replica_ids == self.replicas.keys():
            return routable
        mask = 0
        for r in replica_ids:
            s = self.replicas.get(r)
            if s is not None:
                mask |= 1 << s.bit
        return mask & routable

    def routable_mask(self) -> int:
        if self._routable is None:
            mask = 0
            for s in self.replicas.values():
                if not s.stale:
                    mask |= 1 << s.bit
            self._routable = mask
        return self._routable

    @property
    def num_entries(self) -> int:
        return sum(len(h) for h in self.holders)

    @property
    def has_host_entries(self) -> bool:
        return any(self.host_holders)

    def tiers_view(self) -> list[TierUnion]:
        """Per group, the holders of a page on either tier (what a hit that may promote can use)."""
        return [TierUnion(d, h) for d, h in zip(self.holders, self.host_holders)]


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


class TierUnion:
    """One group's `hash -> replica bitmask` over both tiers (read-only; the scorer's `get`)."""

    __slots__ = ("device", "host")

    def __init__(self, device: dict[BlockHash, int], host: dict[BlockHash, int]) -> None:
        self.device, self.host = device, host

    def get(self, key: BlockHash, default: int = 0) -> int:
        return self.device.get(key, default) | self.host.get(key, default)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.device or key in self.host


class ReplicaView:
    """`CacheLookup` over one replica's entries in the global index (read-only)."""

    __slots__ = ("_holders", "_mask")

    def __init__(self, index: GlobalIndex, bit: int, tiers: bool = False) -> None:
        """`tiers`: a page on the replica's host tier counts too (the worker's own lookup does)."""
        self._holders = index.tiers_view() if tiers else index.holders
        self._mask = 1 << bit

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        return bool(self._holders[group_id].get(block_hash, 0) & self._mask)
