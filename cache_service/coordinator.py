"""The hybrid coordinator: one reconciled hit length that every group can serve.

    A   = lcm(block sizes)                       (alignment)
    cap = num_prompt_tokens - 1                  (the last prompt token is always recomputed)
    L0  = floor(cap / A) * A
    L_{n+1} = min_g longest_servable_g(L_n)      (each group's largest servable length <= L_n)

The sequence only ever decreases and stops at the largest L that every group serves: any L*
all groups serve stays below every iterate, and a fixed point is served by all. EAGLE `drop`
is applied inside each candidate's test (see hit_finders.DroppingProbe), once per candidate,
by the `lookahead` rule (default) or the older `alignment` rule.

Which groups drop in `drop` mode: attention groups annotated as draft groups (explicitly, or
of kind `draft`); if no attention group is annotated, every attention group (the conservative
fallback). A Mamba lookup is exact-position and never drops. Retention keys off
`any_group_drops`, never off a group's own annotation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from enum import Enum
from typing import NamedTuple

from cache_service.block_hash import BlockHash
from cache_service.hit_finders import (
    DroppingProbe,
    DropRule,
    FullAttentionProbe,
    GroupProbe,
    LookupContext,
    make_probe,
)
from cache_service.lookup import CacheLookup
from cache_service.specs import CacheLayout, DraftAttentionSpec, SpecError


class EagleMode(str, Enum):
    OFF = "off"  # no speculative decoding: no group drops
    DROP = "drop"  # dropping groups need proof of the successor token (see DropRule)
    LOSSLESS = "lossless"  # no drop; the engine recomputes the draft layer's last position


class HitResult(NamedTuple):
    hit_tokens: int  # the reconciled hit, a multiple of the alignment, <= num_prompt_tokens - 1
    per_group_hits: tuple[int, ...]  # each group's own answer at the aligned cap, before reconciliation
    attention_match_tokens: int  # aligned length all attention groups match without any drop
    candidates: tuple[int, ...]  # the fixed-point iterates, for explanations
    # where the full/draft groups' contiguous match ends (raw tokens, not aligned, not capped at
    # N - 1); the shared-prefix junction is taken from it (`HybridCoordinator.junctions`)
    prefix_match_tokens: int = 0


class Boundary(NamedTuple):
    """A position a later lookup can land on (aligned), and where the tokens that lookup shares
    with this request (and finds cached) end: the replay boundary of an N-token prompt is
    (floor((N-1)/A)*A, N), the final boundary (floor(T/A)*A, T), a junction at match m
    (floor(m/A)*A, m)."""

    position: int
    extent: int


class HybridCoordinator:
    """Reconciles per-group hits for one cache layout and EAGLE configuration. Stateless per
    lookup: safe to share between threads; the lookup backend provides its own locking."""

    def __init__(
        self,
        layout: CacheLayout,
        eagle: EagleMode | str = EagleMode.OFF,
        draft_groups: Collection[int] = (),
        drop_rule: DropRule | str = DropRule.LOOKAHEAD,
    ) -> None:
        self.layout = layout
        self.eagle = EagleMode(eagle)
        try:
            self.drop_rule = DropRule(drop_rule)
        except ValueError:
            raise SpecError(f"drop rule must be 'lookahead' or 'alignment', got {drop_rule!r}") from None
        for g in draft_groups:
            if not 0 <= g < len(layout.groups):
                raise SpecError(f"draft group index {g} out of range for {len(layout.groups)} groups")
        annotated = set(draft_groups) | {
            i for i, spec in enumerate(layout.groups) if isinstance(spec, DraftAttentionSpec)
        }
        self.annotated_groups = frozenset(annotated)
        attention = set(layout.attention_group_ids)
        if self.eagle is EagleMode.DROP:
            self.dropping_groups = frozenset(annotated & attention or attention)
        else:
            self.dropping_groups = frozenset()

    @property
    def alignment(self) -> int:
        return self.layout.alignment

    @property
    def any_group_drops(self) -> bool:
        return bool(self.dropping_groups)

    def probes(self, hashes: Sequence[BlockHash], num_prompt_tokens: int, lookup: CacheLookup) -> list[GroupProbe]:
        ctx = LookupContext(hashes, self.layout.hash_block_size, self.alignment, num_prompt_tokens - 1, lookup)
        return [
            make_probe(g, spec, ctx, g in self.dropping_groups, self.drop_rule)
            for g, spec in enumerate(self.layout.groups)
        ]

    def find_longest_hit(
        self, hashes: Sequence[BlockHash], num_prompt_tokens: int, lookup: CacheLookup, per_group: bool = True
    ) -> HitResult:
        """The reconciled hit for a request whose prefix hashes are `hashes`. `per_group=False`
        (routing) skips each group's own answer at the cap and leaves `per_group_hits` empty."""
        return self.reconcile(self.probes(hashes, num_prompt_tokens, lookup), per_group)

    def reconcile(self, probes: Sequence[GroupProbe], per_group: bool = True) -> HitResult:
        ctx = probes[0].ctx
        top = ctx.floor(ctx.cap)
        attention = [p.inner if isinstance(p, DroppingProbe) else p for p in probes if p.spec.is_attention]
        match = min((p.longest_servable(top) for p in attention), default=0)
        prefix = [p.match_tokens() for p in attention if isinstance(p, FullAttentionProbe)]
        prefix_match = min(prefix) if prefix else match  # no full/draft group: the windows' aligned match
        own = tuple(p.longest_servable(top) for p in probes) if per_group else ()
        # attention groups first: their answers are cheap (memoised prefix matches) and bound the
        # exact-position scans of the others
        ordered = sorted(probes, key=lambda p: not p.spec.is_attention)
        length, trace = top, [top]
        while length:
            nxt = length
            for probe in ordered:
                nxt = probe.longest_servable(nxt)
                if not nxt:
                    break
            if nxt == length:
                break
            length = nxt
            trace.append(length)
        return HitResult(length, own, match, tuple(trace), prefix_match)

    def landing(self, boundary: Boundary) -> int:
        """Where a later lookup whose groups all hold `boundary.position` lands: the position
        itself, unless some group drops and cannot prove the successor token there (lookahead
        rule: a dropping group's block [position, position + its block size) runs past the
        shared extent; alignment rule: always), then one alignment unit below."""
        if not self.any_group_drops:
            return boundary.position
        if self.drop_rule is DropRule.LOOKAHEAD and all(
            boundary.position + self.layout.groups[g].block_size <= boundary.extent for g in self.dropping_groups
        ):
            return boundary.position
        return boundary.position - self.alignment

    def serving_extent(self, group_id: int, hit_tokens: int) -> int:
        """How far group `group_id`'s cached blocks must reach to serve a hit of `hit_tokens`:
        the hit itself, plus a dropping group's proof of the successor token (its lookahead
        block under the lookahead rule, one alignment unit under the alignment rule). A transfer
        moves exactly these blocks."""
        if group_id not in self.dropping_groups or not hit_tokens:
            return hit_tokens
        if self.drop_rule is DropRule.LOOKAHEAD:
            return hit_tokens + self.layout.groups[group_id].block_size
        return hit_tokens + self.alignment

    def reachable_hit_positions(self, boundaries: Iterable[Boundary]) -> tuple[int, ...]:
        """Where lookups land below the given boundaries (see `landing`), positions > 0 only.
        Retention keeps snapshots at these positions besides the boundaries themselves."""
        out = {self.landing(b) for b in boundaries}
        return tuple(sorted(p for p in out if p > 0))

    def junctions(self, hit: HitResult) -> tuple[int, ...]:
        """The shared-prefix junction a lookup reveals: where the full/draft groups' contiguous
        match ends, when a later lookup sharing that prefix would land above this hit (so a
        snapshot taken there lets the next sibling hit). Sliding-window groups, which keep only
        window tails, never decide it. Used by the engine and the simulations alike."""
        match = hit.prefix_match_tokens
        boundary = Boundary(match // self.alignment * self.alignment, match)
        return (match,) if boundary.position and self.landing(boundary) > hit.hit_tokens else ()
