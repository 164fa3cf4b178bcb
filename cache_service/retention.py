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

Policies add periodic snapshots (`retention_policies.py`): `latest` none, `interval k` every k
tokens (k a positive multiple of A), `dense` every A tokens; `value:BYTES` up to BYTES of states
per request where later lookups are expected to land (`placement.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cache_service.coordinator import Boundary, HybridCoordinator
from cache_service.eviction_policy import RecomputeCost
from cache_service.placement import parse_value_placement
from cache_service.retention_policies import (  # noqa: F401 - the policies' home for callers
    DenseRetention,
    IntervalRetention,
    LatestOnlyRetention,
    RetentionPolicy,
    SpacedRetention,
)
from cache_service.specs import SpecError


def state_bytes_of(layout) -> int:
    """One snapshot's bytes over the layout's Mamba groups (1 when the specs carry no page bytes:
    `value:BYTES` then counts states)."""
    return sum(g.page_size_bytes for g in layout.groups if not g.is_attention) or 1


def make_retention(value: str | int, alignment: int, state_bytes: int = 0,
                   cost: RecomputeCost | None = None, spacing: int = 0) -> RetentionPolicy:
    """`latest`, `dense`, an interval N (a positive multiple of the alignment), or `value:BYTES`
    (`state_bytes`: one snapshot's bytes; `cost`: the recompute model placement weighs by);
    `spacing` > 0 adds a grid state at least every `spacing` tokens (`checkpoint_grid.on_grid`)."""
    policy = _make_retention(value, alignment, state_bytes, cost)
    if spacing <= 0:
        return policy
    if spacing % alignment:
        raise SpecError(f"checkpoint spacing {spacing} must be a multiple of the alignment {alignment}")
    return SpacedRetention(policy, spacing)


def _make_retention(value: str | int, alignment: int, state_bytes: int, cost: RecomputeCost | None) -> RetentionPolicy:
    text = str(value).strip().lower()
    if text.startswith("value:"):
        return parse_value_placement(text, state_bytes, cost)
    if text in ("latest", "0"):
        return LatestOnlyRetention()
    if text == "dense":
        return DenseRetention()
    try:
        interval = int(text)
    except ValueError:
        raise SpecError(
            f"retention must be 'latest', 'dense', a token interval or value:BYTES, got {value!r}") from None
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

    def observe(self, match_tokens: int) -> None:
        """A lookup's attention match ended at `match_tokens`: what placement by value learns from
        (every other policy ignores it). Called once per request, at its first lookup."""
        self.policy.observe(match_tokens, self.coordinator.alignment)

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
        grid = self.policy.periodic_positions(num_computed_tokens, step, needed)
        return frozenset(p for p in grid if 0 < p <= num_computed_tokens and p not in needed)

    def checkpoints(
        self, num_prompt_tokens: int, num_computed_tokens: int, junctions: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """All snapshot positions in (0, num_computed_tokens], ascending."""
        step = self.coordinator.alignment
        marks = self.boundaries(num_prompt_tokens, num_computed_tokens, junctions)
        keep = {m.position for m in marks}
        if self.eagle_aware:
            keep.update(self.coordinator.reachable_hit_positions(marks))
        keep.update(self.policy.periodic_positions(num_computed_tokens, step, frozenset(keep)))
        return tuple(sorted(p for p in keep if 0 < p <= num_computed_tokens))
