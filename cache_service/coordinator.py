"""The hybrid coordinator: one reconciled hit length that every group can serve.

    A   = lcm(block sizes)                       (alignment)
    cap = num_prompt_tokens - 1                  (the last prompt token is always recomputed)
    L0  = floor(cap / A) * A
    L_{n+1} = min_g longest_servable_g(L_n)      (each group's largest servable length <= L_n)

The sequence only ever decreases and stops at the largest L that every group serves: any L*
all groups serve stays below every iterate, and a fixed point is served by all. EAGLE `drop`
is applied inside each candidate's test (see hit_finders.DroppingProbe), once per candidate.

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
from cache_service.hit_finders import DroppingProbe, GroupProbe, LookupContext, make_probe
from cache_service.lookup import CacheLookup
from cache_service.specs import CacheLayout, DraftAttentionSpec, SpecError


class EagleMode(str, Enum):
    OFF = "off"  # no speculative decoding: no group drops
    DROP = "drop"  # dropping groups lose one alignment unit below their own match
    LOSSLESS = "lossless"  # no drop; the engine recomputes the draft layer's last position


class HitResult(NamedTuple):
    hit_tokens: int  # the reconciled hit, a multiple of the alignment, <= num_prompt_tokens - 1
    per_group_hits: tuple[int, ...]  # each group's own answer at the aligned cap, before reconciliation
    attention_match_tokens: int  # aligned length all attention groups match without any drop
    candidates: tuple[int, ...]  # the fixed-point iterates, for explanations


class HybridCoordinator:
    """Reconciles per-group hits for one cache layout and EAGLE configuration. Stateless per
    lookup: safe to share between threads; the lookup backend provides its own locking."""

    def __init__(
        self,
        layout: CacheLayout,
        eagle: EagleMode | str = EagleMode.OFF,
        draft_groups: Collection[int] = (),
    ) -> None:
        self.layout = layout
        self.eagle = EagleMode(eagle)
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
            make_probe(g, spec, ctx, drops=g in self.dropping_groups) for g, spec in enumerate(self.layout.groups)
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
        return HitResult(length, own, match, tuple(trace))

    def reachable_hit_positions(self, match_lengths: Iterable[int]) -> tuple[int, ...]:
        """Where lookups land when the attention groups' raw match ends at each given length:
        the aligned length itself, or one alignment unit below it when some group drops.
        Retention keeps snapshots at these positions (besides the boundaries themselves)."""
        step = self.alignment
        drop = step if self.any_group_drops else 0
        out = {m // step * step - drop for m in match_lengths}
        return tuple(sorted(p for p in out if p > 0))
