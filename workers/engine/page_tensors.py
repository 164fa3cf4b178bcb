"""The page-indexed tensors of one cache group of an engine (`[num_pages, ...]` each, page j of the
group being row j of each), in one fixed order, for whatever moves whole pages between engines:
prefix transfers (`workers/transfer.py`, `transfer_recv.py`) and hand-offs (`handoff.py`).

    full    every layer's K and V (layers in order), then the lossless-EAGLE sidecar when asked
    draft   every MTP layer's K and V
    mamba   every layer's conv state, then every layer's SSM state
"""

from __future__ import annotations

import torch


def page_tensors(cache, group: int, sidecar: bool) -> list[torch.Tensor]:
    """Group `group`'s page tensors of `cache` (an `EngineCacheManager`); `sidecar`: the full
    group's sidecar rows too."""
    caches, kind = cache.caches, cache.layout.groups[group].kind
    if kind == "mamba":
        return [caches.conv[i] for i in sorted(caches.conv)] + [caches.ssm[i] for i in sorted(caches.ssm)]
    pools = caches.draft_kv if kind == "draft" else caches.kv
    rows = [t for i in sorted(pools) for t in pools[i]]
    return rows + [cache.sidecar] if kind == "full" and sidecar else rows
