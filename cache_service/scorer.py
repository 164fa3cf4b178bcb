"""One pass over a request's hash chain scores every replica at once.

The global index stores, per group, `hash -> bitmask of holder replicas`. For each candidate
length L (a multiple of the alignment A, L <= floor(cap / A) * A) and each group g, the set of
replicas on which g serves L is one bitmask, built from the holder masks along the chain:

    full / draft     AND of the holder masks of every block covering [0, L)  (a running AND)
    sliding_window   AND of the holder masks of the blocks covering the last window-1 tokens
    mamba            the holder mask of the snapshot key at L
    dropping group   per the coordinator's drop rule (see `_dropped`)

A replica's reconciled hit is the largest L whose AND over all groups has its bit: the same
answer as the coordinator's fixed point, because each probe's `longest_servable(limit)` is the
largest L <= limit its predicate holds at, and the fixed point is the largest L every group
serves. Walking L from the top down and retiring each replica the first time its bit shows
costs O(blocks * groups) big-int operations plus O(replicas) bit extractions, instead of one
coordinator run per replica. `tests/cache_service/test_scorer.py` checks it against
`HybridCoordinator.find_longest_hit` on random layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cache_service.block_hash import BlockHash
from cache_service.coordinator import HybridCoordinator
from cache_service.specs import MambaSpec, SlidingWindowSpec


@dataclass(frozen=True)
class ReplicaScores:
    """Per replica bit: the reconciled hit and the attention match (both in tokens; absent = 0)."""

    hit_tokens: dict[int, int]
    attention_tokens: dict[int, int]


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class AllReplicaScorer:
    """Stateless per call; `holders[g]` maps a prefix hash to the bitmask of replicas holding it."""

    def __init__(self, coordinator: HybridCoordinator) -> None:
        self.layout = coordinator.layout
        self.alignment = coordinator.alignment
        self.hash_block_size = self.layout.hash_block_size
        self.dropping_groups = coordinator.dropping_groups
        self.drop_rule = str(getattr(getattr(coordinator, "drop_rule", None), "value",
                                     getattr(coordinator, "drop_rule", "alignment")))

    def score(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
              holders: Sequence[Mapping[BlockHash, int]], candidates: int) -> ReplicaScores:
        """Scores for the replicas whose bits are set in `candidates`."""
        A, h = self.alignment, self.hash_block_size
        cap = max(0, min(num_prompt_tokens - 1, len(hashes) * h))
        n = cap // A  # candidate lengths i * A, i = 0..n
        groups = self.layout.groups
        serve: list[list[int]] = [[] for _ in groups]  # per group: the replicas serving i * A, i = 0..n
        attention = []
        # attention groups first: above the highest i at which some replica's attention group
        # serves (`top`, the least over those groups) nobody hits, so the exact-position groups
        # (Mamba) are probed only up to there
        order = sorted(range(len(groups)), key=lambda g: not groups[g].is_attention)
        top = n
        for g in order:
            spec = groups[g]
            masks = self._raw(spec, holders[g], hashes, n if spec.is_attention else top, candidates)
            if spec.is_attention:
                high = n  # this group's highest i served on some replica
                while high and not masks[high]:
                    high -= 1
                attention.append((masks, high))
                top = min(top, high)
            if g in self.dropping_groups:
                masks = self._dropped(spec, holders[g], hashes, masks, num_prompt_tokens, candidates)
            serve[g] = masks + [0] * (n + 1 - len(masks))
        hits = _sweep(serve, top, A, candidates)
        if not attention:
            return ReplicaScores(hits, {})
        per_group = [_sweep([m], high, A, candidates) for m, high in attention]
        match = {b: min(p.get(b, 0) for p in per_group) for b in per_group[0]}
        return ReplicaScores(hits, {b: v for b, v in match.items() if v})

    def _raw(self, spec, holders, hashes, n: int, everyone: int) -> list[int]:
        """masks[i]: the replicas on which this group itself serves i * A, for i = 0..n."""
        A, h = self.alignment, self.hash_block_size
        masks = [everyone] + [0] * n
        get = holders.get
        if isinstance(spec, MambaSpec):
            step = A // h
            for i in range(1, n + 1):
                masks[i] = get(hashes[i * step - 1], 0) & everyone
            return masks
        b = spec.block_size
        per_block = b // h
        if isinstance(spec, SlidingWindowSpec):
            blocks = [get(hashes[(j + 1) * per_block - 1], 0) for j in range(n * A // b)]
            for i in range(1, n + 1):
                end = i * A // b
                acc = everyone
                for j in range(max(0, i * A - (spec.window - 1)) // b, end):
                    acc &= blocks[j]
                    if not acc:
                        break
                masks[i] = acc
            return masks
        acc, per_a = everyone, A // b
        for i in range(1, n + 1):  # a running AND: stops at the first block no replica holds
            for j in range((i - 1) * per_a, i * per_a):
                acc &= get(hashes[(j + 1) * per_block - 1], 0)
            if not acc:
                break
            masks[i] = acc
        return masks

    def _dropped(self, spec, holders, hashes, masks: list[int], num_prompt_tokens: int, everyone: int) -> list[int]:
        """EAGLE drop. "lookahead": serves L iff it serves L and the block of its own size
        starting at L is cached (that block may end at num_prompt_tokens). "alignment" (older
        engines): serves L iff the group serves L + A within the aligned cap, and L itself."""
        n = len(masks) - 1
        if self.drop_rule == "alignment":
            return [everyone] + [masks[i + 1] & masks[i] for i in range(1, n)] + ([0] if n else [])
        A, h, b = self.alignment, self.hash_block_size, spec.block_size
        limit = min(num_prompt_tokens, len(hashes) * h)
        out = [everyone] + [0] * n
        for i in range(1, n + 1):
            end = i * A + b
            if masks[i] and end <= limit:
                out[i] = masks[i] & holders.get(hashes[end // h - 1], 0)
        return out


def _sweep(serve: list[list[int]], n: int, A: int, everyone: int) -> dict[int, int]:
    """Top-down: each replica's largest i * A at which every group's mask has its bit."""
    out: dict[int, int] = {}
    remaining = everyone
    for i in range(n, 0, -1):
        m = remaining
        for masks in serve:
            m &= masks[i]
            if not m:
                break
        if m:
            for bit in _bits(m):
                out[bit] = i * A
            remaining &= ~m
            if not remaining:
                break
    return out
