"""Retention policies: the snapshot positions a request adds besides the boundaries retention always
keeps (`retention.py`); `value:BYTES` is `placement.py`.

    latest      none
    interval k  every k tokens (k a positive multiple of the alignment A)
    dense       every A tokens
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass


class RetentionPolicy(ABC):
    name: str

    @abstractmethod
    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        """Extra snapshot positions in (0, num_tokens] besides the mandatory ones (`fixed`: those
        positions, which a placement by value builds on)."""

    def observe(self, match_tokens: int, alignment: int) -> None:
        """A lookup's attention match ended at `match_tokens` (placement by value learns from it;
        the fixed policies ignore it)."""
        return None

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class LatestOnlyRetention(RetentionPolicy):
    name = "latest"

    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        return ()


@dataclass(frozen=True)
class DenseRetention(RetentionPolicy):
    name = "dense"

    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        return range(alignment, num_tokens + 1, alignment)


@dataclass(frozen=True)
class IntervalRetention(RetentionPolicy):
    interval: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.interval)

    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        return range(self.interval, num_tokens + 1, self.interval)


@dataclass(frozen=True)
class SpacedRetention(RetentionPolicy):
    """`inner` plus a grid state at least every `spacing` tokens (a Mamba block size kept as an
    upper bound on spacing when states sit on the attention grid: `checkpoint_grid.py`)."""

    inner: RetentionPolicy
    spacing: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def describe(self) -> str:
        return f"{self.inner.describe()}, a state at least every {self.spacing} tokens"

    def observe(self, match_tokens: int, alignment: int) -> None:
        self.inner.observe(match_tokens, alignment)

    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        spaced = range(self.spacing, num_tokens + 1, self.spacing)
        return sorted(set(self.inner.periodic_positions(num_tokens, alignment, set(fixed) | set(spaced))) | set(spaced))
