"""Retention: which Mamba snapshots (and sliding-window tails) a request keeps.

Always kept, whatever the policy:
    R = floor((N - 1) / A) * A      the replay boundary: where an identical resend lands
    F = floor(T / A) * A            the final boundary (T = tokens computed when the request
                                    ends): where the next chat turn lands
    junctions                       shared-prefix points where an attention match ran past
                                    the last usable snapshot (the next sibling hits there)
and, when some group's lookup drops (EAGLE `drop`), the position one alignment unit below
each boundary a later lookup cannot land on: under the lookahead rule only where a dropping
group's lookahead block at the boundary cannot exist (the prompt, computed tokens or shared
match ends inside it); under the older alignment rule below every boundary
(`HybridCoordinator.reachable_hit_positions`).

Policies add periodic snapshots: `latest` none, `interval k` every k tokens (k a positive
multiple of A), `dense` every A tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from cache_service.coordinator import Boundary, HybridCoordinator
from cache_service.specs import SpecError


class RetentionPolicy(ABC):
    name: str

    @abstractmethod
    def periodic_positions(self, num_tokens: int, alignment: int) -> Iterable[int]:
        """Extra snapshot positions in (0, num_tokens] besides the mandatory ones."""

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class LatestOnlyRetention(RetentionPolicy):
    name = "latest"

    def periodic_positions(self, num_tokens: int, alignment: int) -> Iterable[int]:
        return ()


@dataclass(frozen=True)
class DenseRetention(RetentionPolicy):
    name = "dense"

    def periodic_positions(self, num_tokens: int, alignment: int) -> Iterable[int]:
        return range(alignment, num_tokens + 1, alignment)


@dataclass(frozen=True)
class IntervalRetention(RetentionPolicy):
    interval: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.interval)

    def periodic_positions(self, num_tokens: int, alignment: int) -> Iterable[int]:
        return range(self.interval, num_tokens + 1, self.interval)


def make_retention(value: str | int, alignment: int) -> RetentionPolicy:
    """`latest`, `dense`, or an interval N (a positive multiple of the alignment)."""
    text = str(value).strip().lower()
    if text in ("latest", "0"):
        return LatestOnlyRetention()
    if text == "dense":
        return DenseRetention()
    try:
        interval = int(text)
    except ValueError:
        raise SpecError(f"retention must be 'latest', 'dense' or a token interval, got {value!r}") from None
    if interval <= 0 or interval % alignment:
        raise SpecError(
            f"retention interval {interval} must be a positive multiple of the alignment {alignment}"
        )
    return IntervalRetention(interval)


@dataclass(frozen=True)
class CheckpointPlanner:
    """Plans the snapshot positions of one request for a layout, EAGLE mode and policy."""

    coordinator: HybridCoordinator
    policy: RetentionPolicy
    eagle_aware: bool = True  # False reproduces the pre-fix behaviour (tests, explanations)

    def replay_boundary(self, num_prompt_tokens: int) -> int:
        step = self.coordinator.alignment
        return (num_prompt_tokens - 1) // step * step

    def boundaries(
        self, num_prompt_tokens: int, num_computed_tokens: int, junctions: Iterable[int] = ()
    ) -> list[Boundary]:
        """The reachable boundaries: replay, final and junctions (aligned, > 0), each with the
        extent a later lookup landing there shares (see `Boundary`)."""
        step = self.coordinator.alignment
        marks = [
            Boundary(self.replay_boundary(num_prompt_tokens), num_prompt_tokens),
            Boundary(num_computed_tokens // step * step, num_computed_tokens),
        ]
        marks += [Boundary(j // step * step, j) for j in junctions]
        return [m for m in marks if 0 < m.position <= num_computed_tokens]

    def periodic(
        self, num_prompt_tokens: int, num_computed_tokens: int, junctions: Iterable[int] = ()
    ) -> frozenset[int]:
        """The checkpoints only the policy's grid asks for (no boundary, none a later lookup at a
        boundary needs): the ones an eviction policy may rank below every boundary state."""
        step = self.coordinator.alignment
        junctions = tuple(junctions)
        marks = self.boundaries(num_prompt_tokens, num_computed_tokens, junctions)
        needed = {m.position for m in marks}
        if self.eagle_aware:
            needed.update(self.coordinator.reachable_hit_positions(marks))
        grid = self.policy.periodic_positions(num_computed_tokens, step)
        return frozenset(p for p in grid if 0 < p <= num_computed_tokens and p not in needed)

    def checkpoints(
        self, num_prompt_tokens: int, num_computed_tokens: int, junctions: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """All snapshot positions in (0, num_computed_tokens], ascending."""
        step = self.coordinator.alignment
        marks = self.boundaries(num_prompt_tokens, num_computed_tokens, junctions)
        keep = {m.position for m in marks}
        keep.update(self.policy.periodic_positions(num_computed_tokens, step))
        if self.eagle_aware:
            keep.update(self.coordinator.reachable_hit_positions(marks))
        return tuple(sorted(p for p in keep if 0 < p <= num_computed_tokens))
