"""The page-indexed tensors of one cache group of an engine (`[num_pages, ...]` each, page j of the
group being row j of each), in one fixed order, for whatever moves whole pages between engines:
prefix transfers (`workers/transfer.py`, `transfer_recv.py`) and hand-offs (`handoff.py`).

    full    every layer's K and V (layers in order), then the lossless-EAGLE sidecar when asked
    draft   every MTP layer's K and V
    mamba   every layer's conv state, then every layer's SSM state

A hand-off reads and writes rows through `read_rows` / `write_rows` / `row_specs`, which also
serve a tensor-parallel engine: there the list is rank 0's tensors, then rank 1's, ... (each rank
holds its shard of every page: `workers/model/tp_pages.py`), then the sidecar (rank 0's engine
keeps it whole). Prefix transfers between TP replicas are not implemented (`page_tensors` raises).
"""

from __future__ import annotations

import torch

from workers.model.tp_pages import local_page_tensors


def page_tensors(cache, group: int, sidecar: bool) -> list[torch.Tensor]:
    """Group `group`'s page tensors of `cache` (an `EngineCacheManager`); `sidecar`: the full
    group's sidecar rows too."""
    caches, kind = cache.caches, cache.layout.groups[group].kind
    rows = local_page_tensors(caches, kind)
    return rows + [cache.sidecar] if kind == "full" and sidecar else rows


def _tp_size(cache) -> int:
    return getattr(cache.caches, "tp_size", 1)


def row_specs(cache, group: int, sidecar: bool) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape of one row) of each tensor `read_rows` returns for the group."""
    kind = cache.layout.groups[group].kind
    if _tp_size(cache) == 1:
        return [(t.dtype, tuple(t.shape[1:])) for t in page_tensors(cache, group, sidecar)]
    local = [(t.dtype, tuple(t.shape[1:])) for t in local_page_tensors(cache.caches.local, kind)]
    extra = [(cache.sidecar.dtype, tuple(cache.sidecar.shape[1:]))] if kind == "full" and sidecar else []
    return local * _tp_size(cache) + extra


def read_rows(cache, group: int, ids: list[int], sidecar: bool) -> tuple[torch.Tensor, ...]:
    """Copies of pages `ids` of the group, one tensor per `row_specs` entry."""
    kind = cache.layout.groups[group].kind
    if _tp_size(cache) == 1:
        tensors = page_tensors(cache, group, sidecar)
        index = torch.tensor(ids, dtype=torch.long, device=tensors[0].device)
        return tuple(t.index_select(0, index) for t in tensors)
    rows = cache.caches.read_rows(kind, ids)
    if kind == "full" and sidecar:
        rows.append(cache.sidecar.index_select(0, torch.tensor(ids, dtype=torch.long, device=cache.sidecar.device)))
    return tuple(rows)


def write_rows(cache, group: int, ids: list[int], rows, sidecar: bool) -> int:
    """Write `read_rows`-shaped `rows` into pages `ids` of the group; the bytes written."""
    kind = cache.layout.groups[group].kind
    nbytes = sum(r.numel() * r.element_size() for r in rows)
    if _tp_size(cache) == 1:
        for t, r in zip(page_tensors(cache, group, sidecar), rows):
            t.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=t.device), r.to(t.device))
        return nbytes
    has_sidecar = kind == "full" and sidecar
    cache.caches.write_rows(kind, ids, list(rows[:-1] if has_sidecar else rows))
    if has_sidecar:
        side = cache.sidecar
        side.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=side.device), rows[-1].to(side.device))
    return nbytes
