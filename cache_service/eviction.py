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
              never snapshots; tau is twice the mean reuse distance seen so far, in requests (at least 1;
              `value:T` takes T times it instead of twice; `value:auto` learns T and how readily it
              admits per pool from the evictions and refusals it regrets: `adaptive_value.py`). Since
                  log v = log(gain * (1 + reuses) / bytes) + t_used / tau  -  t / tau
              and the last term is common to every state, the order only changes on use: a heap,
              Grid states (retention's periodic positions) go before any boundary state (replay,
              final, junction: where a known later request lands) until they serve a hit, so a
              finer grid never costs the states `latest` would keep.
              O(log n) per decision (plus a re-keying when tau has doubled or halved since the
              last: O(n), a few times per run as the mean settles). A snapshot worth less than
              the least valuable retained state is not taken.

KV blocks: under `value` and `marconi` (whose radix tree drops a node's KV with its state) a
cached attention block above every retained state of its prefix can serve no hit, so it is
evicted before any other cached block (`kv_support.py`, `BlockPool`'s spare queue); under `lru`
every attention block is evicted in LRU order, blind to the states.

The interface and the cost model are `eviction_policy.py`; `value` is `value_eviction.py`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from cache_service.adaptive_value import AdaptiveValueEviction
from cache_service.block_hash import BlockHash
from cache_service.eviction_policy import (
    CheckpointEviction,
    EvictionError,
    RecomputeCost,
    StateEntry,
    learn_position,
)
from cache_service.value_eviction import ValueEviction

EVICTION_NAMES = ("lru", "marconi", "value", "value:auto")  # `simulate --eviction all`


class LruEviction(CheckpointEviction):
    name = "lru"

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost | None = None) -> None:
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


class MarconiEviction(CheckpointEviction):
    name = "marconi"

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost | None = None, alpha: float = 1.0) -> None:
        super().__init__(page_bytes, cost)
        if not alpha >= 0:
            raise EvictionError(f"marconi alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._entries: dict[BlockHash, StateEntry] = {}

    def stored(self, key, position, parent, periodic=False) -> None:
        self._entries[key] = StateEntry(position, self.gain(position, parent), 0, self.now)

    def used(self, key, restored, position) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            learn_position(self, entry, position)
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


@dataclass(frozen=True)
class EvictionConfig:
    """The policy by name (`lru`, `marconi`, `marconi:ALPHA`, `value`, `value:T`, `value:auto`) and the
    model's attention crossover (see the module doc); `build` makes one policy object per Mamba pool."""

    policy: str = "value"
    crossover_tokens: float = math.inf

    @property
    def joint_kv(self) -> bool:
        """Whether attention blocks no retained state makes usable go first (`kv_support.py`):
        value and marconi (whose radix tree evicts a node's KV with its state); lru is blind."""
        return self.build().name != "lru"

    def __post_init__(self) -> None:
        if not self.crossover_tokens > 0:
            raise EvictionError(f"crossover_tokens must be positive, got {self.crossover_tokens}")
        self.build()  # raises EvictionError on an unknown policy

    def build(self, page_bytes: int = 1) -> CheckpointEviction:
        return make_eviction(self.policy, page_bytes, RecomputeCost(self.crossover_tokens))


def make_eviction(spec: str, page_bytes: int = 1, cost: RecomputeCost | None = None) -> CheckpointEviction:
    """`lru`, `marconi`, `marconi:ALPHA`, `value`, `value:T` (T: tau per mean reuse distance) or
    `value:auto` (T and admission learned per pool: `adaptive_value.py`)."""
    name, _, arg = str(spec).strip().lower().partition(":")
    if name == "lru" and not arg:
        return LruEviction(page_bytes, cost)
    if name == "value":
        if arg == "auto":
            return AdaptiveValueEviction(page_bytes, cost)
        try:
            tau_per_mean_reuse = float(arg) if arg else ValueEviction.TAU_PER_MEAN_REUSE
        except ValueError:
            raise EvictionError(f"eviction {spec!r}: expected value:T with a number, or value:auto") from None
        return ValueEviction(page_bytes, cost, tau_per_mean_reuse=tau_per_mean_reuse)
    if name == "marconi":
        try:
            alpha = float(arg) if arg else 1.0
        except ValueError:
            raise EvictionError(f"eviction {spec!r}: expected marconi:ALPHA with a number") from None
        return MarconiEviction(page_bytes, cost, alpha)
    raise EvictionError(f"unknown eviction policy {spec!r}; expected one of lru, marconi[:ALPHA], value[:T|auto]")
