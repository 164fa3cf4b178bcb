"""The interface every eviction policy of retained Mamba states implements (`eviction.py` names the
policies), and what they share: the recompute cost model and a state's bookkeeping.

cost(p) = p + p^2 / (2 * crossover): FLOPs to recompute p tokens, in units of one token's linear
(SSM + MLP) FLOPs; a token's attention FLOPs equal its linear ones at `crossover` tokens of
context (from the model's dimensions; inf for a model without attention, or when unknown).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.block_hash import BlockHash

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

    def __init__(self, page_bytes: int = 1, cost: RecomputeCost | None = None) -> None:
        self.page_bytes = max(1, page_bytes)
        self.cost = cost if cost is not None else RecomputeCost()
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

    def evicted(self, key: BlockHash) -> None:
        """`key`, which this policy named, is about to be evicted (before `removed`). An optional
        hook, as are `refused` and `missed`: only a policy that learns from its regrets uses them."""
        return None

    def refused(self, key: BlockHash) -> None:
        """A snapshot under `key` was not taken: `admits` said it was worth less than the victim."""
        return None

    def missed(self, prefix: Sequence[BlockHash], hit_blocks: int) -> None:
        """A request was admitted with a hit of `hit_blocks` blocks of its prompt's block hashes
        `prefix` (a policy that learns from the states it regrets evicting looks past the hit)."""
        return None

    def position_of(self, key: BlockHash) -> int:
        """The position of a tracked state (0: unknown; the host tier ranks a demoted state by it)."""
        return getattr(self.known().get(key), "position", 0)

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


@dataclass
class StateEntry:
    position: int
    gain: float
    num_reuses: int
    last_use: int
    periodic: bool = False


def learn_position(policy: CheckpointEviction, entry: StateEntry, position: int) -> None:
    if not entry.position and position > 0:  # adopted (a transfer): its gain over nothing below
        entry.position, entry.gain = position, policy.gain(position, 0)
