"""Where a Mamba state may sit: the checkpoint grid.

    attention   on the attention block (the lcm of the attention groups' block sizes): a Mamba
                group's block size only bounds the spacing (a grid state at least every that many
                tokens, ranked below boundary states) and its page sets the bytes. A hit can land
                on any attention-block boundary, as in vLLM 0.33 (Mamba states on the 64-token
                grid under a 2304-token page).
    mamba       on the Mamba group's own block (the alignment is the lcm of every group's block
                size): older engines; `explain`'s seed rows reproduce them with it.

`on_grid` turns a layout as the model describes it (each Mamba group at its page's token count)
into the layout the cache runs, and says what spacing bound remains; `SpacedRetention` (in
`retention_policies.py`) adds that bound to a retention policy.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import reduce

from cache_service.specs import CacheLayout, SpecError

GRIDS = ("attention", "mamba")


def parse_grid(text: str) -> str:
    grid = str(text).strip().lower()
    if grid not in GRIDS:
        raise SpecError(f"checkpoint grid must be attention or mamba, got {text!r}")
    return grid


def on_grid(layout: CacheLayout, grid: str) -> tuple[CacheLayout, int]:
    """(the layout the cache runs, the spacing bound in tokens; 0: none). Under `attention` every
    Mamba group's block becomes the attention block and the old alignment, when larger, becomes
    the spacing bound; a layout without attention groups, or `mamba`, is returned as it is."""
    if parse_grid(grid) == "mamba":
        return layout, 0
    attention = [g.block_size for g in layout.groups if g.is_attention]
    if not attention:
        return layout, 0
    unit = reduce(math.lcm, attention)
    moved = CacheLayout(tuple(replace(g, block_size=unit) if g.kind == "mamba" else g for g in layout.groups))
    return moved, layout.alignment if layout.alignment > moved.alignment else 0
