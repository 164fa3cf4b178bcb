"""Per-kind hit semantics: the largest hit length a single group can serve.

Every finder answers one question, `longest_servable(limit)`: the largest L <= limit, L a
multiple of the alignment A, such that this group can serve a hit of L tokens (L = 0 always
can). The coordinator composes the answers into a fixed point. Finders are built per lookup
(`start`), so each memoises the cache probes of one request and never repeats them.

EAGLE `drop` is a wrapper, not a mode flag inside each finder. The draft layer's KV at L - 1
was computed from the successor token at L, which the hash of the prefix [0, L) does not cover,
so a dropping group needs proof that token L is the same. Two rules (`DropRule`):

    lookahead (default)   serves L iff the inner group serves L AND the block of the group's own
                          size that starts at L is cached (it proves the successor token; it may
                          end at the prompt's last token, the cap N - 1 bounds L only)

        tokens   [ ... L-bs ... L-1 ][ L ... L+bs-1 ][ ...
                   served block      lookahead block: cached under the chained hash => token L equal

    alignment (older)     serves L iff the inner group serves L + A within the aligned cap: one
                          alignment unit lost below its own match, as the seed fix did

Either drop is applied once per candidate length, which keeps the fixed point from spiralling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum

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

    @property
    def num_hashed_tokens(self) -> int:
        """Tokens covered by full hash blocks: the end of the last block a lookup can probe."""
        return len(self.hashes) * self.hash_block_size

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

    def block_cached_from(self, start: int) -> bool:
        """The block of this group's size that starts at `start` is cached (and lies inside the
        prompt's full hash blocks): the EAGLE lookahead proof of the successor token."""
        end = start + self.spec.block_size
        return end <= self.ctx.num_hashed_tokens and self._cached(end)


class FullAttentionProbe(GroupProbe):
    """Serves L iff every block covering [0, L) is cached: a contiguous prefix match."""

    def __init__(self, group_id: int, spec: GroupSpec, ctx: LookupContext) -> None:
        super().__init__(group_id, spec, ctx)
        self._match: int | None = None

    def match_tokens(self) -> int:
        """Contiguous cached blocks over the prompt's full blocks (not capped at N - 1: the block
        ending at the last prompt token can still be an EAGLE lookahead block)."""
        if self._match is None:
            size, end = self.spec.block_size, self.ctx.num_hashed_tokens
            matched = 0
            while matched + size <= end and self._cached(matched + size):
                matched += size
            self._match = matched
        return self._match

    def longest_servable(self, limit: int) -> int:
        return self.ctx.floor(min(limit, self.ctx.cap, self.match_tokens()))

    def block_cached_from(self, start: int) -> bool:
        return start + self.spec.block_size <= self.match_tokens() or super().block_cached_from(start)

    def why(self, hit: int) -> str:
        match = self.match_tokens()
        blocks = match // self.spec.block_size
        if match + self.spec.block_size > self.ctx.num_hashed_tokens:
            stop = "the prompt's last full block"
        else:
            stop = f"block {blocks} (tokens {match}..{match + self.spec.block_size}) not cached"
        # the cap is num_prompt_tokens - 1, or the end of the prompt's last full hash block if lower
        source = "the prompt's full blocks" if self.ctx.cap == self.ctx.num_hashed_tokens else "num_prompt_tokens - 1"
        return (f"{blocks} contiguous blocks cached ({match} tokens), stopped by {stop}; capped at "
                f"{self.ctx.cap} ({source}) and aligned to {hit}")


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


class DropRule(str, Enum):
    LOOKAHEAD = "lookahead"  # serves L iff it serves L and the block starting at L is cached
    ALIGNMENT = "alignment"  # older engines: serves L iff it serves L + A (one unit lost)


class DroppingProbe(GroupProbe):
    """EAGLE `drop` around a group's own probe; `inner` answers without any drop."""

    def __init__(self, inner: GroupProbe) -> None:
        super().__init__(inner.group_id, inner.spec, inner.ctx)
        self.inner = inner


class LookaheadDropProbe(DroppingProbe):
    """Serves L iff the wrapped group serves L and its block [L, L + block_size) is cached."""

    def longest_servable(self, limit: int) -> int:
        length = self.inner.longest_servable(limit)
        while length and not self.inner.block_cached_from(length):
            length = self.inner.longest_servable(length - self.ctx.alignment)
        return length

    def why(self, hit: int) -> str:
        top = self.ctx.floor(self.ctx.cap)
        own = self.inner.longest_servable(top)
        size = self.spec.block_size
        text = f"{self.inner.why(own)}; EAGLE drop (lookahead) needs block [L, L+{size}) cached"
        if own > hit:
            end = own + size
            missing = (f"runs past the prompt's full blocks ({self.ctx.num_hashed_tokens} tokens)"
                       if end > self.ctx.num_hashed_tokens else "is not cached")
            text += f": at {own} the lookahead block [{own}, {end}) {missing}"
        if hit:
            text += f"; at {hit} lookahead block [{hit}, {hit + size}) cached -> {hit}"
        else:
            text += " -> 0"
        return text


class AlignmentDropProbe(DroppingProbe):
    """The older rule: serves L iff the wrapped group serves L + A within the aligned cap (and,
    for sliding windows, whose tails are not nested, L itself: a longer length alone proves
    nothing about the window blocks before L)."""

    def longest_servable(self, limit: int) -> int:
        step, top = self.ctx.alignment, self.ctx.floor(self.ctx.cap)
        length = min(self.ctx.floor(limit), top - step)
        while length > 0:
            reach = self.inner.longest_servable(length + step)
            if reach < step:
                return 0
            if reach < length + step:
                length = reach - step
            elif self.inner.longest_servable(length) == length:
                return length
            else:
                length -= step
        return 0

    def why(self, hit: int) -> str:
        own = self.inner.longest_servable(self.ctx.floor(self.ctx.cap))
        return f"{self.inner.why(own)}; EAGLE drop (alignment rule) removes one alignment unit -> {hit}"


PROBE_BY_SPEC: dict[type[GroupSpec], type[GroupProbe]] = {
    FullAttentionSpec: FullAttentionProbe,
    DraftAttentionSpec: FullAttentionProbe,
    SlidingWindowSpec: SlidingWindowProbe,
    MambaSpec: MambaProbe,
}


DROP_PROBE_BY_RULE: dict[DropRule, type[DroppingProbe]] = {
    DropRule.LOOKAHEAD: LookaheadDropProbe,
    DropRule.ALIGNMENT: AlignmentDropProbe,
}


def make_probe(
    group_id: int, spec: GroupSpec, ctx: LookupContext, drops: bool, rule: DropRule = DropRule.LOOKAHEAD
) -> GroupProbe:
    probe = PROBE_BY_SPEC[type(spec)](group_id, spec, ctx)
    return DROP_PROBE_BY_RULE[rule](probe) if drops else probe
