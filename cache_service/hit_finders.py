"""Per-kind hit semantics: the largest hit length a single group can serve.

Every finder answers one question, `longest_servable(limit)`: the largest L <= limit, L a
multiple of the alignment A, such that this group can serve a hit of L tokens (L = 0 always
can). The coordinator composes the answers into a fixed point. Finders are built per lookup
(`start`), so each memoises the cache probes of one request and never repeats them.

EAGLE `drop` is a wrapper, not a mode flag inside each finder: a dropping group serves L iff
its own lookup serves L + A within the cap, i.e. it loses exactly one alignment unit below its
own match. The drop is applied once per candidate length, which is what keeps the fixed point
from spiralling to zero:

    candidate L ----> dropping group asks its inner finder for <= min(L + A, cap)
                      inner answers r (a multiple of A)  ---> serves r - A
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from cache_service.block_hash import BlockHash
from cache_service.lookup import CacheLookup
from cache_service.specs import (
    DraftAttentionSpec,
    FullAttentionSpec,
    GroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)


class LookupContext:
    """What one request's lookup sees: its prefix hashes and the cap (num_prompt_tokens - 1)."""

    __slots__ = ("hashes", "hash_block_size", "alignment", "cap", "lookup")

    def __init__(
        self, hashes: Sequence[BlockHash], hash_block_size: int, alignment: int, cap: int, lookup: CacheLookup
    ) -> None:
        self.hashes = hashes
        self.hash_block_size = hash_block_size
        self.alignment = alignment
        self.cap = max(0, min(cap, len(hashes) * hash_block_size))
        self.lookup = lookup

    def floor(self, num_tokens: int) -> int:
        return num_tokens // self.alignment * self.alignment

    def prefix_hash(self, num_tokens: int) -> BlockHash:
        return self.hashes[num_tokens // self.hash_block_size - 1]


class GroupProbe(ABC):
    """One group's view of one lookup."""

    def __init__(self, group_id: int, spec: GroupSpec, ctx: LookupContext) -> None:
        self.group_id = group_id
        self.spec = spec
        self.ctx = ctx

    @abstractmethod
    def longest_servable(self, limit: int) -> int:
        """Largest L <= limit (L % A == 0) this group can serve; 0 if none."""

    @abstractmethod
    def why(self, hit: int) -> str:
        """One line: why this group stopped at `hit`."""

    def _cached(self, num_tokens: int) -> bool:
        return self.ctx.lookup.is_cached(self.group_id, self.ctx.prefix_hash(num_tokens))


class FullAttentionProbe(GroupProbe):
    """Serves L iff every block covering [0, L) is cached: a contiguous prefix match."""

    def __init__(self, group_id: int, spec: GroupSpec, ctx: LookupContext) -> None:
        super().__init__(group_id, spec, ctx)
        self._match: int | None = None

    def match_tokens(self) -> int:
        if self._match is None:
            size, end = self.spec.block_size, self.ctx.cap
            matched = 0
            while matched + size <= end and self._cached(matched + size):
                matched += size
            self._match = matched
        return self._match

    def longest_servable(self, limit: int) -> int:
        return self.ctx.floor(min(limit, self.match_tokens()))

    def why(self, hit: int) -> str:
        match = self.match_tokens()
        blocks = match // self.spec.block_size
        stop = "request cap (num_prompt_tokens - 1)" if match + self.spec.block_size > self.ctx.cap else (
            f"block {blocks} (tokens {match}..{match + self.spec.block_size}) not cached"
        )
        return f"{blocks} contiguous blocks cached ({match} tokens), stopped by {stop}; aligned to {hit}"


class SlidingWindowProbe(GroupProbe):
    """Serves L iff the blocks covering the last `window - 1` tokens before L are cached."""

    def __init__(self, group_id: int, spec: SlidingWindowSpec, ctx: LookupContext) -> None:
        super().__init__(group_id, spec, ctx)
        self._run: list[int] | None = None

    def _runs(self) -> list[int]:
        """run[j] = number of consecutive cached blocks ending at block j (inclusive)."""
        if self._run is None:
            size = self.spec.block_size
            run, prev = [], 0
            for j in range(self.ctx.cap // size):
                prev = prev + 1 if self._cached((j + 1) * size) else 0
                run.append(prev)
            self._run = run
        return self._run

    def serves(self, num_tokens: int) -> bool:
        if num_tokens == 0:
            return True
        size, window = self.spec.block_size, self.spec.window
        end = num_tokens // size
        start = max(0, num_tokens - (window - 1)) // size
        return self._runs()[end - 1] >= end - start

    def longest_servable(self, limit: int) -> int:
        step = self.ctx.alignment
        for length in range(self.ctx.floor(limit), 0, -step):
            if self.serves(length):
                return length
        return 0

    def why(self, hit: int) -> str:
        top = self.ctx.floor(self.ctx.cap)
        if hit == top:
            return f"window tail before {hit} cached; {hit} is the aligned request cap"
        return (
            f"no cached window tail (last {self.spec.window - 1} tokens) before any aligned length in "
            f"({hit}, {top}]; the tail before {hit} is cached" if hit else
            f"no cached window tail (last {self.spec.window - 1} tokens) before any aligned length <= {top}"
        )


class MambaProbe(GroupProbe):
    """Serves L iff a state snapshot taken exactly at L is cached."""

    def longest_servable(self, limit: int) -> int:
        step = self.ctx.alignment
        for length in range(self.ctx.floor(limit), 0, -step):
            if self._cached(length):
                return length
        return 0

    def cached_positions(self) -> list[int]:
        size = self.spec.block_size
        return [p for p in range(size, self.ctx.cap + 1, size) if self._cached(p)]

    def why(self, hit: int) -> str:
        held = self.cached_positions()
        shown = ", ".join(map(str, held[-6:])) or "none"
        more = f" ({len(held)} in all)" if len(held) > 6 else ""
        if hit:
            return f"state snapshot at {hit}; snapshots held at <= cap: [{shown}]{more}"
        return f"no state snapshot at any aligned length <= the limit; snapshots held: [{shown}]{more}"


class DroppingProbe(GroupProbe):
    """EAGLE `drop`: serves L iff the wrapped group serves L + A within the cap."""

    def __init__(self, inner: GroupProbe) -> None:
        super().__init__(inner.group_id, inner.spec, inner.ctx)
        self.inner = inner

    def longest_servable(self, limit: int) -> int:
        step = self.ctx.alignment
        reach = self.inner.longest_servable(min(limit + step, self.ctx.floor(self.ctx.cap)))
        return reach - step if reach >= step else 0

    def why(self, hit: int) -> str:
        own = self.inner.longest_servable(self.ctx.floor(self.ctx.cap))
        return f"{self.inner.why(own)}; EAGLE drop removes one alignment unit -> {hit}"


PROBE_BY_SPEC: dict[type[GroupSpec], type[GroupProbe]] = {
    FullAttentionSpec: FullAttentionProbe,
    DraftAttentionSpec: FullAttentionProbe,
    SlidingWindowSpec: SlidingWindowProbe,
    MambaSpec: MambaProbe,
}


def make_probe(group_id: int, spec: GroupSpec, ctx: LookupContext, drops: bool) -> GroupProbe:
    probe = PROBE_BY_SPEC[type(spec)](group_id, spec, ctx)
    return DroppingProbe(probe) if drops else probe
