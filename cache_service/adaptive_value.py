"""`value:auto`: the value policy with its recency scale T (tau per mean reuse distance) and how
readily it admits a snapshot learned online per pool, from the states it regrets losing.

`value`'s one constant trades recency against gain: a small T keeps what was used lately (chat,
where a turn's state is superseded by the next turn's), a large T keeps long, proven prefixes for
long (the shipped trace). Which is right depends on the trace and on the pool's share of it, so
here each pool learns it, as ARC and LeCaR learn between recency and frequency:

- an evicted state is remembered as a ghost (metadata only, as many ghosts as retained states):
  its age at eviction, and the mean age of the states retained then;
- when a later request's prompt passes a ghost deeper than the hit it got (`missed`), that
  eviction is regretted: a victim older than the pool's mean went for being old, so T grows
  (recency should have counted less); a younger one went for its small gain, so T shrinks;
- T moves by a factor `STEP` per regret, within [`MIN_T`, `MAX_T`], starting at `value`'s 2;
  tau is T x the mean reuse distance, or T x `PRIOR_MEAN_REUSE` until a reuse is seen (a pool of
  one or two states may never restore one, and its T must still count);
- a snapshot `admits` refused is a ghost too: a regretted refusal raises an admission bias (log
  worth given to a new snapshot against the victim) by `DELTA`; a regretted eviction made to
  admit a snapshot lowers it by `DELTA`, never below 0 (`value`'s test).

Each regret costs O(1); the manager finds it with one dict probe per block of the prompt above
the hit. When T has moved tau out of 2x of the tau the heap's keys were made with, the heap is
re-keyed (O(n)), at most once per n / `REKEY_EVERY` requests: amortized O(1) per request, where
a T moving at every request would otherwise re-key every few (`python -m bench.eviction`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.block_hash import BlockHash
from cache_service.eviction_policy import RecomputeCost
from cache_service.value_eviction import ValueEviction


@dataclass(frozen=True)
class Ghost:
    age: int  # requests since its last use, when it was evicted
    mean_age: float  # the retained states' mean age then
    cause: str  # "evicted", "admitted" (evicted for a snapshot `admits` let in), "refused"


class AdaptiveValueEviction(ValueEviction):
    name = "value"
    # T moves by STEP per regretted eviction; the admission bias by DELTA (log worth) per regretted
    # refusal or admission. `python -m bench.memory_pressure --traces shipped,chat,agent` over
    # STEP 1.05 / 1.1 / 1.2, DELTA 0.1 / 0.25 / 0.5 and a start at T = 1 or 2 (docs/DEVLOG.md):
    # every setting matched Marconi as published in 21-22 of 23 cells at 4 digits (value: 20); the R = 16 cells
    # move within their seed spread between settings. T starts at value's 2.
    STEP = 1.1
    DELTA = 0.25
    MIN_T, MAX_T = 0.25, 64.0
    START_T = ValueEviction.TAU_PER_MEAN_REUSE
    REKEY_EVERY = 64
    PRIOR_MEAN_REUSE = 32.0  # requests, until a reuse is seen: value's prior tau of 64 at T = 2

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost | None = None) -> None:
        super().__init__(page_bytes, cost, self.START_T * self.PRIOR_MEAN_REUSE, self.START_T)
        self.ghosts: OrderedDict[BlockHash, Ghost] = OrderedDict()
        self._last_use_sum = 0
        self.num_regrets = 0
        self.bias = 0.0  # learned: raised by regretted refusals, lowered by regretted admissions
        self._admitting: BlockHash | None = None
        self._rekeyed_at = 0

    # the retained states' last uses, summed: their mean age in O(1)
    def stored(self, key, position, parent, periodic=False) -> None:
        old = self._entries.get(key)
        if old is not None:
            self._last_use_sum -= old.last_use
        self.ghosts.pop(key, None)
        super().stored(key, position, parent, periodic)
        self._last_use_sum += self.now

    def used(self, key, restored, position) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._last_use_sum += self.now - entry.last_use
        super().used(key, restored, position)

    def removed(self, key) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._last_use_sum -= entry.last_use
        super().removed(key)

    def evicted(self, key: BlockHash) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        self._remember(key, self.now - entry.last_use, "admitted" if key == self._admitting else "evicted")
        self._admitting = None

    def admits(self, position, parent, victim, periodic=False) -> bool:
        ok = super().admits(position, parent, victim, periodic)
        self._admitting = victim if ok else None  # an eviction of it now is an admission's
        return ok

    def refused(self, key: BlockHash) -> None:
        if self._entries:
            self._remember(key, 0, "refused")

    def _remember(self, key: BlockHash, age: int, cause: str) -> None:
        mean_age = self.now - self._last_use_sum / len(self._entries)
        self.ghosts[key] = Ghost(age, mean_age, cause)
        self.ghosts.move_to_end(key)
        while len(self.ghosts) > max(16, len(self._entries)):
            self.ghosts.popitem(last=False)

    def missed(self, prefix: Sequence[BlockHash], hit_blocks: int) -> None:
        if not self.ghosts:
            return
        ghosts = self.ghosts
        for i in range(len(prefix) - 1, hit_blocks - 1, -1):  # the deepest ghost past the hit
            ghost = ghosts.pop(prefix[i], None)
            if ghost is not None:
                self.num_regrets += 1
                if ghost.cause == "refused":
                    self.bias += self.DELTA
                    return
                if ghost.cause == "admitted":
                    self.bias = max(0.0, self.bias - self.DELTA)
                step = self.STEP if ghost.age > ghost.mean_age else 1 / self.STEP
                self.tau_per_mean_reuse = min(self.MAX_T, max(self.MIN_T, self.tau_per_mean_reuse * step))
                self._retau()
                self._rekey_if_drifted()
                return

    def _retau(self) -> None:
        if self._num_reuses:
            super()._retau()
        else:  # no reuse seen yet: T still counts, over the prior mean
            self.tau = max(self.MIN_TAU, self.tau_per_mean_reuse * self.PRIOR_MEAN_REUSE)

    def _may_rekey(self) -> bool:
        """At most one re-keying (O(n)) per n / `REKEY_EVERY` requests: amortized O(1) per request
        however often T moves (a pool of fewer than `REKEY_EVERY` states: any time)."""
        return self.now - self._rekeyed_at >= len(self._entries) // self.REKEY_EVERY

    def _rebuild(self) -> None:
        self._rekeyed_at = self.now
        super()._rebuild()
