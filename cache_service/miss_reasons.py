"""Why a lookup hit less than the cache held of its prompt: one reason per short hit, from the
same probes the lookup ran (`explain`, the engine's per-request report and the
`hybridserve_prefix_cache_misses{reason}` counter share this vocabulary).

A lookup is *short* when the cache held some of its prefix and the reconciled hit stopped below
what the attention groups alone would serve (or at 0 with a shared prefix under one grid unit).
Its reason, in the order checked (the first that applies):

    kv_evicted          a Mamba state further on is cached, but the attention blocks before it
                        were evicted (a state at p is only ever stored after [0, p) was published),
                        or a sliding-window tail below the cached prefix was
    below_grid          the shared prefix is shorter than one alignment unit A: no hit can land
    eagle_drop          without the EAGLE drop the fixed point would land higher: a dropping group
                        could not prove the token after it (lookahead block missing, or the older
                        alignment rule's unit)
    state_evicted       a Mamba state between the hit and the attention match was stored and
                        evicted (the last `capacity` evictions are remembered, `RecentlyEvicted`)
    state_not_retained  no state was ever kept there: retention keeps boundaries, junctions and
                        its grid, and a prompt diverging from an earlier one leaves a junction
                        state only now (the next prompt sharing that prefix hits)
    salt                nothing shared in this tenant's namespace, but an earlier request began
                        with the same A tokens under another `cache_salt` (`SaltedPrefixes`)

Cost: a full hit (at the cached prefix's grid point) is settled from the `HitResult` in O(groups).
A short one re-runs the fixed point without the drop (only when some group drops; the attention
probes are memoised, Mamba probes scan the positions the lookup scanned) and looks the
positions between the hit and the attention match up in the eviction record: at most the
lookup's own work again, and only on short hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from cache_service.block_hash import BlockHash, RequestBlockHashes, root_hash
from cache_service.coordinator import HitResult, HybridCoordinator
from cache_service.hit_finders import DroppingProbe, GroupProbe
from cache_service.specs import CacheLayout


class MissReason(str, Enum):
    KV_EVICTED = "kv_evicted"
    BELOW_GRID = "below_grid"
    EAGLE_DROP = "eagle_drop"
    STATE_EVICTED = "state_evicted"
    STATE_NOT_RETAINED = "state_not_retained"
    SALT = "salt"


# what each reason means; `{position}` is the report's `reason_position`, `{alignment}` A
REASONS: dict[MissReason, str] = {
    MissReason.KV_EVICTED: "attention KV blocks were evicted: attention serves no hit above {position}, "
                           "short of what the cache still holds of this prompt (a Mamba state further on, or "
                           "the blocks past a missing window tail)",
    MissReason.BELOW_GRID: "the cache held only {position} tokens of this prompt (up to its last token), less "
                           "than one {alignment}-token grid unit: no hit can land",
    MissReason.EAGLE_DROP: "without the EAGLE drop the hit would be {position}: a dropping group could not prove "
                           "the token after it (its lookahead block is not cached, or the alignment rule "
                           "gives up one unit)",
    MissReason.STATE_EVICTED: "the Mamba state at {position} was retained, then evicted under memory pressure",
    MissReason.STATE_NOT_RETAINED: "no Mamba state was ever kept between the hit and {position}: retention keeps "
                                   "the replay and final boundaries, junctions and its grid; a prompt diverging "
                                   "from an earlier one leaves a junction state now, so the next one hits",
    MissReason.SALT: "an earlier request began with the same {alignment} tokens under another cache_salt: "
                     "tenants never share cache",
}


@dataclass(frozen=True)
class LookupReport:
    """One request's lookup, as the engine did it at admission: what `explain` shows for a served
    request. Small (O(groups)); it travels on the request's outputs."""

    num_prompt_tokens: int
    hit_tokens: int
    per_group_hits: tuple[int, ...]
    attention_match_tokens: int  # aligned, capped, no drop: where attention alone would let a hit land
    shared_prefix_tokens: int  # the cached contiguous prefix, capped at num_prompt_tokens - 1
    candidates: tuple[int, ...]  # the fixed point's iterates
    reason: str | None = None  # a MissReason value; None: not short
    reason_position: int = 0  # see REASONS
    # the hit's pages copied back from the host tier, per group (empty: none; `host_tier.py`)
    host_promoted_pages: tuple[int, ...] = ()

    @classmethod
    def of(cls, num_prompt_tokens: int, hit: HitResult, probes: Sequence[GroupProbe],
           reason: tuple[MissReason, int] | None) -> LookupReport:
        shared = min(hit.prefix_match_tokens, probes[0].ctx.cap) if probes else 0
        name, position = (reason[0].value, reason[1]) if reason else (None, 0)
        return cls(num_prompt_tokens, hit.hit_tokens, tuple(hit.per_group_hits), hit.attention_match_tokens,
                   shared, tuple(hit.candidates), name, position)

    def with_reason(self, reason: MissReason, position: int) -> LookupReport:
        return replace(self, reason=reason.value, reason_position=position)


def describe_reason(reason: str, position: int, alignment: int) -> str:
    return REASONS[MissReason(reason)].format(position=position, alignment=alignment)


def classify_miss(coordinator: HybridCoordinator, probes: Sequence[GroupProbe], hit: HitResult,
                  evicted: Container[BlockHash] = ()) -> tuple[MissReason, int] | None:
    """Why `hit` (reconciled from `probes` with per-group answers, the probes still reading the
    cache as the lookup did) is short; None when it is not (see the module docstring).
    `evicted`: prefix hashes of recently evicted Mamba states."""
    if not probes:
        return None
    ctx = probes[0].ctx
    shared = min(hit.prefix_match_tokens, ctx.cap)
    reach = ctx.floor(shared)  # the hit the cached prefix allows on the grid
    attention = hit.attention_match_tokens  # what every attention group serves, no drop (<= reach)
    states = [own for own, p in zip(hit.per_group_hits, probes) if not p.spec.is_attention]
    if attention < max([reach, *states]):  # blocks below a cached state, or a window tail, were evicted
        return MissReason.KV_EVICTED, attention
    if hit.hit_tokens >= reach:
        return (MissReason.BELOW_GRID, shared) if shared and not hit.hit_tokens else None
    if coordinator.any_group_drops:
        undropped = [p.inner if isinstance(p, DroppingProbe) else p for p in probes]
        without = coordinator.reconcile(undropped, per_group=False).hit_tokens
        if without > hit.hit_tokens:
            return MissReason.EAGLE_DROP, without
    if not states:  # attention groups alone stopped below their own answers: a window tail is missing
        return MissReason.KV_EVICTED, hit.hit_tokens
    for position in range(attention, hit.hit_tokens, -ctx.alignment):
        if ctx.prefix_hash(position) in evicted:
            return MissReason.STATE_EVICTED, position
    return MissReason.STATE_NOT_RETAINED, attention


class RecentlyEvicted:
    """The prefix hashes of the last `capacity` Mamba states evicted from a replica's pools: a
    tap on its `EventSink` (`removed` events of the state groups), O(1) per evicted state."""

    def __init__(self, layout: CacheLayout, capacity: int) -> None:
        self.group_ids = frozenset(g for g, spec in enumerate(layout.groups) if not spec.is_attention)
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __call__(self, group_id: int, block_hashes: tuple[BlockHash, ...]) -> None:
        if group_id not in self.group_ids:
            return
        for key in block_hashes:
            self._hashes[key] = None
            self._hashes.move_to_end(key)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(False)  # the oldest

    def __contains__(self, key: object) -> bool:
        return key in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)


class SaltedPrefixes:
    """Which tenant (a digest of its `cache_salt`) last sent each first-`alignment`-token prefix,
    for the last `capacity` distinct prefixes: what tells a `salt` miss. O(alignment) per request
    (one hash of the first unit, never the whole prompt); salts are kept only as digests."""

    def __init__(self, alignment: int, capacity: int) -> None:
        self.alignment = alignment
        self.capacity = capacity
        self._tenants: OrderedDict[BlockHash, BlockHash] = OrderedDict()

    def observe(self, prompt: Sequence[int], cache_salt: str | None) -> bool:
        """Record this request; True when an earlier request began with the same `alignment`
        tokens under another salt. Prompts of at most `alignment` tokens can never hit: ignored."""
        if len(prompt) <= self.alignment:
            return False
        key = RequestBlockHashes(self.alignment, prompt[: self.alignment]).hashes[0]
        tenant = root_hash(cache_salt=cache_salt)
        before = self._tenants.pop(key, None)
        self._tenants[key] = tenant
        if len(self._tenants) > self.capacity:
            self._tenants.popitem(False)  # the oldest
        return before is not None and before != tenant


def salt_miss(report: LookupReport, alignment: int) -> LookupReport:
    """`report` relabelled `salt` (an earlier request shared its first unit under another salt):
    only when nothing of the prompt was cached in its own namespace (then no other reason applies)."""
    if not report.shared_prefix_tokens:
        return report.with_reason(MissReason.SALT, alignment)
    return report
