"""Which retained Mamba checkpoint goes when one must, and whether a new snapshot earns a place.

One policy object per Mamba pool, held by `MambaManager`: the engine's pools and every simulation
(the trace simulator, `explain`, `simulate`) run the same object, so they evict the same states.

    lru       least recently stored or restored goes first; every snapshot is taken. O(1).
    marconi   Marconi (MLSys 2025) as published: over the retained states, the lowest
                  score = recency_norm + alpha * efficiency_norm
              goes, each term min-max normalized over the candidates; efficiency = recompute
              FLOPs the state saves per byte; every snapshot is taken (its admission rule, the
              reuse taxonomy, is the planner's `latest` positions: prompt end, final, junctions).
              O(n) per decision, as its normalization needs every candidate.
    value     ours: expected recompute FLOPs saved per byte, decayed by the requests since use
                  v = gain / bytes * (1 + reuses) * exp(-(t - t_used) / tau)
              gain: what a hit here saves beyond the nearest retained state below it on the same
              prefix that has served a hit, cost(p) - cost(q) (a state above a shared system
              prompt's is worth the tokens past it; a request's own grid, never reused yet,
              is worth its whole prefix, so its deepest state outranks the rest); t counts admitted requests,
              never snapshots; tau is the mean reuse distance seen so far, in requests. Since
                  log v = log(gain * (1 + reuses) / bytes) + t_used / tau  -  t / tau
              and the last term is common to every state, the order only changes on use: a heap,
              Grid states (retention's periodic positions) go before any boundary state (replay,
              final, junction: where a known later request lands) until they serve a hit, so a
              finer grid never costs the states `latest` would keep.
              O(log n) per decision (plus a re-keying when tau has doubled or halved since the
              last: O(n), a few times per run as the mean settles). A snapshot worth less than
              the least valuable retained state is not taken.

cost(p) = p + p^2 / (2 * crossover): FLOPs to recompute p tokens, in units of one token's linear
(SSM + MLP) FLOPs; a token's attention FLOPs equal its linear ones at `crossover` tokens of
context (from the model's dimensions; inf for a model without attention, or when unknown).
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cache_service.block_hash import BlockHash

EVICTION_NAMES = ("lru", "marconi", "value")

Evictable = Callable[[BlockHash], bool | None]  # True: free to evict; False: pinned; None: gone


class EvictionError(ValueError):
    """An unknown eviction policy or a bad parameter."""


@dataclass(frozen=True)
class RecomputeCost:
    """FLOPs to recompute a prefix, in units of one token's linear FLOPs."""

    crossover_tokens: float = math.inf

    def __call__(self, num_tokens: int) -> float:
        return num_tokens + num_tokens * num_tokens / (2.0 * self.crossover_tokens)


class CheckpointEviction(ABC):
    """The interface `MambaManager` drives; keys are prefix hashes of retained states."""

    name: str

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost = RecomputeCost()) -> None:
        self.page_bytes = max(1, page_bytes)
        self.cost = cost
        self.now = 0  # admitted requests

    def tick(self) -> None:
        """A request was admitted: the clock recency is measured in."""
        self.now += 1

    def gain(self, position: int, parent: int) -> float:
        """FLOPs per byte a state at `position` saves over the retained one at `parent` below it."""
        return (self.cost(position) - self.cost(parent)) / self.page_bytes

    @abstractmethod
    def stored(self, key: BlockHash, position: int, parent: int, periodic: bool = False) -> None:
        """A snapshot at `position` was retained (`parent`: the nearest reused state below it;
        `periodic`: a retention grid position, not a boundary a known later request lands on)."""

    @abstractmethod
    def used(self, key: BlockHash, restored: bool, position: int) -> None:
        """A retained state at `position` was restored from (`restored`) or snapshotted again.
        A state adopted without a position (a transfer registered it) learns it here."""

    @abstractmethod
    def removed(self, key: BlockHash) -> None:
        """A retained state left the pool (evicted by this policy or behind its back)."""

    @abstractmethod
    def victim(self, evictable: Evictable) -> BlockHash | None:
        """The state to evict now among those `evictable` says are free; None if none is."""

    def is_reused(self, key: BlockHash) -> bool:
        """Whether the retained state `key` has served a hit (a proven shared prefix)."""
        return False

    def admits(self, position: int, parent: int, victim: BlockHash, periodic: bool = False) -> bool:
        """With the budget full: is a new snapshot worth more than `victim`? (Default: yes.)"""
        return True

    def __len__(self) -> int:
        return len(self.known())

    @abstractmethod
    def known(self) -> set[BlockHash] | dict:
        """The keys this policy tracks (the manager adopts pages cached behind its back)."""


class LruEviction(CheckpointEviction):
    name = "lru"

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost = RecomputeCost()) -> None:
        super().__init__(page_bytes, cost)
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def stored(self, key, position, parent, periodic=False) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def used(self, key, restored, position) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable):
        found, gone = None, []
        for key in self._order:  # oldest first; pinned states are rare and short-lived
            state = evictable(key)
            if state is None:
                gone.append(key)
            elif state:
                found = key
                break
        for key in gone:
            del self._order[key]
        return found

    def known(self):
        return self._order


@dataclass
class _Entry:
    position: int
    gain: float
    num_reuses: int
    last_use: int
    periodic: bool = False


def _learn_position(policy: CheckpointEviction, entry: _Entry, position: int) -> None:
    if not entry.position and position > 0:  # adopted (a transfer): its gain over nothing below
        entry.position, entry.gain = position, policy.gain(position, 0)


class MarconiEviction(CheckpointEviction):
    name = "marconi"

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost = RecomputeCost(), alpha: float = 1.0) -> None:
        super().__init__(page_bytes, cost)
        if not alpha >= 0:
            raise EvictionError(f"marconi alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._entries: dict[BlockHash, _Entry] = {}

    def stored(self, key, position, parent, periodic=False) -> None:
        self._entries[key] = _Entry(position, self.gain(position, parent), 0, self.now)

    def used(self, key, restored, position) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            _learn_position(self, entry, position)
            entry.last_use = self.now
            entry.num_reuses += int(restored)

    def removed(self, key) -> None:
        self._entries.pop(key, None)

    def victim(self, evictable):
        candidates = []
        for key in list(self._entries):
            state = evictable(key)
            if state is None:
                del self._entries[key]
            elif state:
                candidates.append((key, self._entries[key]))
        if not candidates:
            return None
        uses = [e.last_use for _, e in candidates]
        gains = [e.gain for _, e in candidates]
        lo_u, span_u = min(uses), (max(uses) - min(uses)) or 1
        lo_g, span_g = min(gains), (max(gains) - min(gains)) or 1.0

        def score(item):
            _, e = item
            return (e.last_use - lo_u) / span_u + self.alpha * (e.gain - lo_g) / span_g, e.last_use

        return min(candidates, key=score)[0]

    def is_reused(self, key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.num_reuses > 0

    def known(self):
        return self._entries


class ValueEviction(CheckpointEviction):
    name = "value"
    MIN_TAU = 16.0  # requests: a few quick resends must not make every older state worthless

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost = RecomputeCost(), tau: float = 64.0) -> None:
        super().__init__(page_bytes, cost)
        self.tau = tau  # requests: a prior until reuses are seen, then their mean distance
        self._keyed_tau = tau  # the tau heap keys were computed with
        self._entries: dict[BlockHash, _Entry] = {}
        self._heap: list[tuple[tuple[bool, float], int, BlockHash]] = []
        self._version: dict[BlockHash, int] = {}
        self._seq = 0
        self._reuse_sum, self._num_reuses = 0, 0

    def worth(self, key: BlockHash) -> float:
        """v of the module doc for a retained state, now (explanations, tests)."""
        e = self._entries[key]
        return e.gain * (1 + e.num_reuses) * math.exp(-(self.now - e.last_use) / self.tau)

    def _priority(self, entry: _Entry) -> tuple[bool, float]:
        """(boundary, log worth + last use / tau): grid states go before any boundary state."""
        return (not entry.periodic or entry.num_reuses > 0,
                math.log(max(entry.gain, 1e-30) * (1 + entry.num_reuses)) + entry.last_use / self._keyed_tau)

    def _push(self, key: BlockHash, entry: _Entry) -> None:
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
        entry = self._entries[key] = _Entry(position, self.gain(position, parent), 0, self.now, periodic)
        self._push(key, entry)

    def used(self, key, restored, position) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        _learn_position(self, entry, position)
        if restored:
            self._reuse_sum += self.now - entry.last_use
            self._num_reuses += 1
            entry.num_reuses += 1
            self.tau = max(self.MIN_TAU, self._reuse_sum / self._num_reuses)
        entry.last_use = self.now
        if not 0.5 <= self.tau / self._keyed_tau <= 2.0:  # keys drifted: re-key all (rare)
            self._rebuild()
        else:
            self._push(key, entry)

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
        new = _Entry(position, self.gain(position, parent), 0, self.now, periodic)
        return self._priority(new) > self._priority(self._entries[victim])

    def known(self):
        return self._entries


@dataclass(frozen=True)
class EvictionConfig:
    """The policy by name (`lru`, `marconi`, `marconi:ALPHA`, `value`) and the model's attention
    crossover (see the module doc); `build` makes one policy object per Mamba pool."""

    policy: str = "value"
    crossover_tokens: float = math.inf

    def __post_init__(self) -> None:
        if not self.crossover_tokens > 0:
            raise EvictionError(f"crossover_tokens must be positive, got {self.crossover_tokens}")
        self.build()  # raises EvictionError on an unknown policy

    def build(self, page_bytes: int = 1) -> CheckpointEviction:
        return make_eviction(self.policy, page_bytes, RecomputeCost(self.crossover_tokens))


def make_eviction(spec: str, page_bytes: int = 1, cost: RecomputeCost = RecomputeCost()) -> CheckpointEviction:
    """`lru`, `marconi`, `marconi:ALPHA` or `value`."""
    name, _, arg = str(spec).strip().lower().partition(":")
    if name == "lru" and not arg:
        return LruEviction(page_bytes, cost)
    if name == "value" and not arg:
        return ValueEviction(page_bytes, cost)
    if name == "marconi":
        try:
            alpha = float(arg) if arg else 1.0
        except ValueError:
            raise EvictionError(f"eviction {spec!r}: expected marconi:ALPHA with a number") from None
        return MarconiEviction(page_bytes, cost, alpha)
    raise EvictionError(f"unknown eviction policy {spec!r}; expected one of lru, marconi[:ALPHA], value")
