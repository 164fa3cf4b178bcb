"""Cacheability at a glance: what a layout, EAGLE mode and retention let a prompt hit, derived
from the coordinator and the checkpoint planner (never a second copy of their rules).

    hit grid             A = lcm(block sizes): every hit is a multiple of it
    shortest hit prompt  the shortest prompt whose identical resend hits: the smallest N whose
                         replay boundary R = floor((N - 1) / A) * A lands above 0
                         (`HybridCoordinator.landing`; retention always keeps R and, in drop
                         mode, the landing below it), e.g. A + 1 without a drop, A + the draft
                         block under the lookahead rule, 2A + 1 under the alignment rule
    needs                per group, what a hit of L needs of it

The server logs `lines()` at startup; `explain` and `/v1/cache/explain/{id}` report `as_dict()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from cache_service.coordinator import Boundary, HybridCoordinator
from cache_service.hit_finders import DropRule
from cache_service.retention import (
    CheckpointPlanner,
    DenseRetention,
    IntervalRetention,
    LatestOnlyRetention,
    RetentionPolicy,
    SpacedRetention,
)
from cache_service.specs import GroupSpec, SlidingWindowSpec


@dataclass(frozen=True)
class CacheProfile:
    groups: tuple[str, ...]
    alignment: int
    hash_block_size: int
    eagle: str
    drop_rule: str | None  # how dropping groups prove the successor token; None: no group drops
    dropping_groups: tuple[int, ...]
    retention: str
    shortest_hit_prompt: int  # tokens
    needs: tuple[str, ...]  # one line per group
    prefix_caching: bool = True

    def lines(self, model: str) -> list[str]:
        """The startup block: a headline, then one line per group."""
        if not self.prefix_caching:
            return [f"cacheability of {model}: prefix caching is disabled: no prompt hits"]
        eagle = f"EAGLE {self.eagle}" + (f" ({self.drop_rule} rule)" if self.drop_rule else "")
        head = (f"cacheability of {model}: hit grid {self.alignment} tokens (lcm of {', '.join(self.groups)}); "
                f"shortest prompt that can hit: {self.shortest_hit_prompt} tokens (an identical resend; {eagle}; "
                f"retention {self.retention})")
        return [head, *(f"  {need}" for need in self.needs)]

    def as_dict(self) -> dict:
        return {"groups": list(self.groups), "alignment": self.alignment, "hash_block_size": self.hash_block_size,
                "eagle": self.eagle, "drop_rule": self.drop_rule, "dropping_groups": list(self.dropping_groups),
                "retention": self.retention, "shortest_hit_prompt": self.shortest_hit_prompt,
                "needs": list(self.needs), "prefix_caching": self.prefix_caching}


def shortest_hit_prompt(coordinator: HybridCoordinator, planner: CheckpointPlanner) -> int:
    """The smallest prompt length whose identical resend lands on a hit above 0 (found by
    N = 2A + 1 at the latest: its boundary 2A lands at A or above under either rule)."""
    return next(n for n in count() if coordinator.landing(Boundary(planner.replay_boundary(n), n)) > 0)


def _kept_states(policy: RetentionPolicy, alignment: int) -> str:
    if isinstance(policy, SpacedRetention):
        return f"{_kept_states(policy.inner, alignment)}, and at least every {policy.spacing} tokens"
    if isinstance(policy, LatestOnlyRetention):
        return "kept at the replay and final boundaries and at shared-prefix junctions (retention latest)"
    if isinstance(policy, DenseRetention):
        return f"kept every {alignment} tokens (retention dense)"
    if isinstance(policy, IntervalRetention):
        return f"kept every {policy.name} tokens and at the boundaries (retention {policy.name})"
    return (f"kept at the boundaries and junctions, plus up to {policy.name.split(':', 1)[1]} bytes per request "
            f"where later lookups are expected to land (retention {policy.name})")


def _need(spec: GroupSpec, policy: RetentionPolicy, alignment: int) -> str:
    if spec.kind == "mamba":
        return f"a state snapshot exactly at the hit, {_kept_states(policy, alignment)}"
    if isinstance(spec, SlidingWindowSpec):
        return f"the {spec.block_size}-token blocks covering the {spec.window - 1} tokens before the hit"
    what = "draft KV" if spec.kind == "draft" else "KV"
    return f"every {spec.block_size}-token {what} block of the prefix"


def cache_profile(coordinator: HybridCoordinator, policy: RetentionPolicy, prefix_caching: bool = True) -> CacheProfile:
    layout, alignment = coordinator.layout, coordinator.alignment
    planner = CheckpointPlanner(coordinator, policy)
    needs = []
    for g, spec in enumerate(layout.groups):
        need = f"{spec.describe()}: {_need(spec, policy, alignment)}"
        if g in coordinator.dropping_groups:
            need += (f"; EAGLE drop: the {spec.block_size}-token block starting at the hit too"
                     if coordinator.drop_rule is DropRule.LOOKAHEAD
                     else f"; EAGLE drop: one {alignment}-token unit below what it matches (alignment rule)")
        needs.append(need)
    drops = coordinator.any_group_drops
    return CacheProfile(
        groups=tuple(layout.describe()), alignment=alignment, hash_block_size=layout.hash_block_size,
        eagle=coordinator.eagle.value, drop_rule=coordinator.drop_rule.value if drops else None,
        dropping_groups=tuple(sorted(coordinator.dropping_groups)), retention=policy.describe(),
        shortest_hit_prompt=shortest_hit_prompt(coordinator, planner), needs=tuple(needs),
        prefix_caching=prefix_caching)


__all__ = ["CacheProfile", "cache_profile", "shortest_hit_prompt"]
