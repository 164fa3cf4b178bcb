"""Cache group specs: what each KV-cache group stores and at what granularity.

A hybrid model's cache is split into groups of layers that share a kind and a block size.
Memory is described by frozen specs (vLLM v1 style); the hit semantics of each kind live in
`hit_finders.py`, chosen through a spec -> finder map, never through mode branches.

    full            attention KV for every token; a hit of L needs every block covering [0, L)
    sliding_window  attention KV inside a window; a hit of L needs the blocks covering the
                    last `window - 1` tokens before L
    mamba           a recurrent state snapshot; a hit of L needs a snapshot taken exactly at L
    draft           the MTP/EAGLE draft layers' attention KV (full-attention semantics)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import ClassVar


class SpecError(ValueError):
    """A group spec or a layout is invalid (bad block size, window, empty layout...)."""


@dataclass(frozen=True)
class GroupSpec:
    """Base spec: one KV-cache group. `block_size` is in tokens; `page_size_bytes` is the size
    of one block (attention) or one state page (mamba) across all layers of the group."""

    block_size: int
    page_size_bytes: int = 0
    kind: ClassVar[str] = "abstract"
    is_attention: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise SpecError(f"{self.kind}: block size must be a positive integer, got {self.block_size!r}")
        if self.page_size_bytes < 0:
            raise SpecError(f"{self.kind}: page_size_bytes must be >= 0, got {self.page_size_bytes}")

    def describe(self) -> str:
        return f"{self.kind}:{self.block_size}"


@dataclass(frozen=True)
class FullAttentionSpec(GroupSpec):
    kind: ClassVar[str] = "full"
    is_attention: ClassVar[bool] = True


@dataclass(frozen=True)
class DraftAttentionSpec(GroupSpec):
    """Attention KV of the MTP/EAGLE draft layers; always annotated as a draft group."""

    kind: ClassVar[str] = "draft"
    is_attention: ClassVar[bool] = True


@dataclass(frozen=True)
class SlidingWindowSpec(GroupSpec):
    window: int = 0
    kind: ClassVar[str] = "sliding_window"
    is_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.window, int) or self.window <= 1:
            raise SpecError(f"sliding_window: window must be an integer > 1, got {self.window!r}")

    def describe(self) -> str:
        return f"{self.kind}:{self.block_size}:{self.window}"


@dataclass(frozen=True)
class MambaSpec(GroupSpec):
    """Mamba/SSM state pages; `block_size` is the checkpoint granularity in tokens."""

    kind: ClassVar[str] = "mamba"


SPEC_BY_KIND: dict[str, type[GroupSpec]] = {
    cls.kind: cls for cls in (FullAttentionSpec, SlidingWindowSpec, MambaSpec, DraftAttentionSpec)
}


def parse_group_spec(text: str) -> GroupSpec:
    """Parse `KIND:BLOCK[:WINDOW]` (e.g. `full:64`, `sliding_window:16:32`, `mamba:2304`)."""
    parts = text.strip().split(":")
    kind = parts[0].strip().lower().replace("-", "_")
    aliases = {"swa": "sliding_window", "attention": "full", "ssm": "mamba"}
    kind = aliases.get(kind, kind)
    if kind not in SPEC_BY_KIND:
        raise SpecError(f"unknown group kind {parts[0]!r} in {text!r}; expected one of {sorted(SPEC_BY_KIND)}")
    want = 3 if kind == "sliding_window" else 2
    if len(parts) != want:
        form = "sliding_window:BLOCK:WINDOW" if kind == "sliding_window" else f"{kind}:BLOCK"
        raise SpecError(f"bad group {text!r}: expected {form}")
    try:
        numbers = [int(p) for p in parts[1:]]
    except ValueError:
        raise SpecError(f"bad group {text!r}: block size and window must be integers") from None
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size=numbers[0], window=numbers[1])
    return SPEC_BY_KIND[kind](block_size=numbers[0])


@dataclass(frozen=True)
class CacheLayout:
    """The ordered groups of one model. Derived values are properties so they never drift.

    alignment        A = lcm(block sizes): every reconciled hit is a multiple of A.
    hash_block_size  h = gcd(block sizes): the granularity of the chained block hashes; every
                     group block and every multiple of A ends on a hash-block boundary.
    """

    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise SpecError("a cache layout needs at least one group")

    @property
    def alignment(self) -> int:
        return reduce(math.lcm, (g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        return reduce(math.gcd, (g.block_size for g in self.groups))

    @property
    def attention_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.is_attention)

    def describe(self) -> list[str]:
        return [g.describe() for g in self.groups]
