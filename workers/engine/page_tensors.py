"""The page-indexed tensors of one cache group of an engine (`[num_pages, ...]` each, page j of the
group being row j of each), in one fixed order, for whatever moves whole pages between engines:
prefix transfers (`workers/transfer.py`, `transfer_recv.py`) and hand-offs (`handoff.py`).

    full    every layer's K and V (layers in order), then the lossless-EAGLE sidecar when asked
    draft   every MTP layer's K and V
    mamba   every layer's conv state, then every layer's SSM state

A hand-off reads and writes rows through `read_rows` / `write_rows` / `row_specs`, which also
serve a tensor-parallel engine: there the list is rank 0's tensors, then rank 1's, ... (each rank
holds its shard of every page: `workers/model/tp_pages.py`), then the sidecar (rank 0's engine
keeps it whole). Prefix transfers use them at TP > 1 too (`workers/transfer_rows.py`); there
`page_tensors` raises (a rank 0 engine holds no whole page tensor), so only a TP 1 transfer reads
the cache tensors in place.
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


def _model_tensors(cache, kind: str) -> list[torch.Tensor]:
    """The page tensors the model's caches hold for a group kind: all of them at TP 1, rank 0's
    shard (one of `tp_size` equal ones) otherwise."""
    caches = cache.caches
    return local_page_tensors(caches.local if tp_size_of(cache) > 1 else caches, kind)


def tp_size_of(cache) -> int:
    """The engine's TP size: how many ranks' shards every page has."""
    return getattr(cache.caches, "tp_size", 1)


def _sidecar(cache, group: int, sidecar: bool) -> torch.Tensor | None:
    """The engine's sidecar when the group carries it (the full group, asked for): rank 0 keeps it
    whole, so it travels after every rank's rows."""
    return cache.sidecar if sidecar and cache.layout.groups[group].kind == "full" else None


def _index(ids: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=like.device)


def row_specs(cache, group: int, sidecar: bool) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape of one row) of each tensor `read_rows` returns for the group."""
    side = _sidecar(cache, group, sidecar)
    tensors = _model_tensors(cache, cache.layout.groups[group].kind) * tp_size_of(cache)
    return [(t.dtype, tuple(t.shape[1:])) for t in tensors + ([] if side is None else [side])]


def read_rows(cache, group: int, ids: list[int], sidecar: bool) -> tuple[torch.Tensor, ...]:
    """Copies of pages `ids` of the group, one tensor per `row_specs` entry."""
    kind, side = cache.layout.groups[group].kind, _sidecar(cache, group, sidecar)
    if tp_size_of(cache) == 1:
        rows = [t.index_select(0, _index(ids, t)) for t in _model_tensors(cache, kind)]
    else:
        rows = cache.caches.read_rows(kind, ids)
    return tuple(rows + ([] if side is None else [side.index_select(0, _index(ids, side))]))


def write_rows(cache, group: int, ids: list[int], rows, sidecar: bool) -> int:
    """Write `read_rows`-shaped `rows` into pages `ids` of the group; the bytes written."""
    kind, side = cache.layout.groups[group].kind, _sidecar(cache, group, sidecar)
    model_rows = list(rows[:-1] if side is not None else rows)
    if tp_size_of(cache) == 1:
        for t, r in zip(_model_tensors(cache, kind), model_rows):
            t.index_copy_(0, _index(ids, t), r.to(t.device))
    else:
        cache.caches.write_rows(kind, ids, model_rows)
    if side is not None:
        side.index_copy_(0, _index(ids, side), rows[-1].to(side.device))
    return sum(r.numel() * r.element_size() for r in rows)
