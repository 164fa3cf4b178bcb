"""`value`: the eviction policy of retained Mamba states ranked by expected recompute FLOPs saved per
byte (the formula and why it is a heap: `eviction.py`)."""

from __future__ import annotations

import heapq
import math

from cache_service.block_hash import BlockHash
from cache_service.eviction_policy import CheckpointEviction, EvictionError, RecomputeCost, StateEntry, learn_position


class ValueEviction(CheckpointEviction):
    name = "value"
    # requests: only a guard against a zero mean (reuses by the very next request). It was 16; at
    # R = 16, where a replica holds ~10 states and sees reuses a few requests apart, that floor made
    # recency count for little against gain, so value kept stale long prefixes. With 1 (KV valued
    # jointly in both runs, `python -m bench.memory_pressure`, 6 Dec): chat R = 16 at 25/50/100%
    # 0.640/0.760/0.803 -> 0.726/0.789/0.807 (Marconi's best alpha 0.724/0.783/0.807), shipped
    # R = 16 10% 0.082 -> 0.085; 36 -> 39 of 52 checks.
    MIN_TAU = 1.0
    # tau per mean reuse distance: reuse distances are heavy-tailed (most reuses come soon, some
    # much later), so a state idle for one mean distance is still often reused; at 2 a state
    # loses 1/e of its worth over two means. Measured with `python -m bench.memory_pressure`
    # (shipped and chat traces, R=1, 10-100% of the working set): 1 lost to Marconi's best alpha
    # at 10% of the shipped trace (0.146 vs 0.150); 2 won every cell but chat at 100% (by 1e-4);
    # 3 and 8 lost some (docs/DEVLOG.md has the figures). The default of `value`; `value:T` sets
    # it (1 won shipped R = 16 at 10% over 8 seeds, 0.096 vs 0.087, but lost R = 1 at 10%).
    TAU_PER_MEAN_REUSE = 2.0
    bias = 0.0  # log worth a new snapshot is given against the victim in `admits` (value:auto learns it)

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost | None = None, tau: float = 64.0,
                 tau_per_mean_reuse: float = TAU_PER_MEAN_REUSE) -> None:
        super().__init__(page_bytes, cost)
        if not (math.isfinite(tau_per_mean_reuse) and tau_per_mean_reuse > 0):
            raise EvictionError(f"value tau per mean reuse distance must be positive and finite, "
                                f"got {tau_per_mean_reuse}")
        self.tau_per_mean_reuse = tau_per_mean_reuse
        self.tau = tau  # requests: a prior until reuses are seen, then tau_per_mean_reuse x their mean distance
        self._keyed_tau = tau  # the tau heap keys were computed with
        self._entries: dict[BlockHash, StateEntry] = {}
        self._heap: list[tuple[tuple[bool, float], int, BlockHash]] = []
        self._version: dict[BlockHash, int] = {}
        self._seq = 0
        self._reuse_sum, self._num_reuses = 0, 0

    def worth(self, key: BlockHash) -> float:
        """v of the module doc for a retained state, now (explanations, tests)."""
        e = self._entries[key]
        return e.gain * (1 + e.num_reuses) * math.exp(-(self.now - e.last_use) / self.tau)

    def _priority(self, entry: StateEntry) -> tuple[bool, float]:
        """(boundary, log worth + last use / tau): grid states go before any boundary state."""
        return (not entry.periodic or entry.num_reuses > 0,
                math.log(max(entry.gain, 1e-30) * (1 + entry.num_reuses)) + entry.last_use / self._keyed_tau)

    def _push(self, key: BlockHash, entry: StateEntry) -> None:
        self._seq += 1
        self._version[key] = self._seq
        heapq.heappush(self._heap, (self._priority(entry), self._seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:  # drop stale entries: amortized O(1)
            self._rebuild()

    def _rebuild(self) -> None:
        self._keyed_tau = self.tau
        self._heap = []
        for key, entry in self._entries.items():
            self._seq += 1
            self._version[key] = self._seq
            self._heap.append((self._priority(entry), self._seq, key))
        heapq.heapify(self._heap)

    def stored(self, key, position, parent, periodic=False) -> None:
        entry = self._entries[key] = StateEntry(position, self.gain(position, parent), 0, self.now, periodic)
        self._push(key, entry)

    def used(self, key, restored, position) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        learn_position(self, entry, position)
        if restored:
            self._reuse_sum += self.now - entry.last_use
            self._num_reuses += 1
            entry.num_reuses += 1
            self._retau()
        entry.last_use = self.now
        if not self._rekey_if_drifted():
            self._push(key, entry)

    def _retau(self) -> None:
        """tau = tau_per_mean_reuse x the mean reuse distance (the prior until a reuse is seen)."""
        if self._num_reuses:
            self.tau = max(self.MIN_TAU, self.tau_per_mean_reuse * self._reuse_sum / self._num_reuses)

    def _rekey_if_drifted(self) -> bool:
        """Re-key every state (rare) when tau has doubled or halved since the heap's keys were
        made, and `_may_rekey` allows it now; whether it did."""
        if 0.5 <= self.tau / self._keyed_tau <= 2.0 or not self._may_rekey():
            return False
        self._rebuild()
        return True

    def _may_rekey(self) -> bool:
        """Whether a drifted heap may be re-keyed now (here: always; `value:auto` rations it)."""
        return True

    def removed(self, key) -> None:
        self._entries.pop(key, None)
        self._version.pop(key, None)

    def victim(self, evictable):
        heap, pinned, found = self._heap, [], None
        while heap:
            item = heap[0]
            key = item[2]
            if self._version.get(key) != item[1]:
                heapq.heappop(heap)  # superseded by a later push, or removed
                continue
            state = evictable(key)
            if state is None:
                heapq.heappop(heap)
                self.removed(key)
            elif state:
                found = key
                break
            else:
                pinned.append(heapq.heappop(heap))
        for item in pinned:
            heapq.heappush(heap, item)
        return found

    def is_reused(self, key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.num_reuses > 0

    def admits(self, position, parent, victim, periodic=False) -> bool:
        """Whether a new snapshot's priority, its log worth raised by `bias`, exceeds the victim's."""
        boundary, worth = self._priority(StateEntry(position, self.gain(position, parent), 0, self.now, periodic))
        return (boundary, worth + self.bias) > self._priority(self._entries[victim])

    def known(self):
        return self._entries
