"""Whole cache pages read from and written to every rank of a tensor-parallel replica (a hand-off of
a request between TP replicas, issue 31). Each rank holds its shard of every page (its heads of K
and V, its channels of the Mamba states), with the same page ids on every rank.

    rank 0: caches.read_rows(kind, ids)        --->  GATHER_ROWS  [kind, ids...]
            every rank puts its rows' bytes in its slot of a zeroed uint8 [tp, n] buffer; a sum
            all-reduce (exact on bytes) gives rank 0 every rank's rows, rank-major
    rank 0: caches.write_rows(kind, ids, rows) --->  SCATTER_ROWS [kind, ids...]
            rank 0 broadcasts uint8 [tp, n] of every rank's rows; each rank writes its slot

`kind`: 0 the full-attention KV (every layer's K, V), 1 the draft layers' KV, 2 the Mamba states
(every layer's conv, then SSM), in `local_page_tensors`' order: the same list on every rank, so a
package's tensors are, per group, rank 0's list, then rank 1's, ... (`workers.engine.page_tensors`).
A buffer carries a whole group's rows for all ranks (tp x the bytes moved: a gather, not a
point-to-point stream; fine for a hand-off's pages, which a step's forward dwarfs).
"""

from __future__ import annotations

import torch

from workers.model.caches import ModelCaches
from workers.model.tp_group import TPGroup

KINDS = ("full", "draft", "mamba")


def local_page_tensors(caches: ModelCaches, kind: str) -> list[torch.Tensor]:
    """This rank's page tensors of one cache group kind (module docstring's order)."""
    if kind == "mamba":
        return [caches.conv[i] for i in sorted(caches.conv)] + [caches.ssm[i] for i in sorted(caches.ssm)]
    pools = caches.draft_kv if kind == "draft" else caches.kv
    return [t for i in sorted(pools) for t in pools[i]]


def _row_bytes(tensors: list[torch.Tensor]) -> list[int]:
    return [t[0].numel() * t.element_size() for t in tensors]


def _flat(rows: list[torch.Tensor]) -> torch.Tensor:
    if not rows:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([r.contiguous().view(-1).view(torch.uint8) for r in rows])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor], num_rows: int) -> list[torch.Tensor]:
    out, start = [], 0
    for t, n in zip(like, _row_bytes(like)):
        size = n * num_rows
        out.append(flat[start : start + size].view(t.dtype).view(num_rows, *t.shape[1:]))
        start += size
    return out


def gather_rows(caches: ModelCaches, group: TPGroup, kind: str, ids: list[int]) -> list[torch.Tensor]:
    """Every rank runs this for one GATHER_ROWS; rank 0's result: every rank's rows, rank-major."""
    tensors = local_page_tensors(caches, kind)
    index = torch.tensor(ids, dtype=torch.long, device=tensors[0].device) if tensors else None
    flat = _flat([t.index_select(0, index) for t in tensors]).to(group.device)
    buf = torch.zeros(group.world_size, flat.numel(), dtype=torch.uint8, device=group.device)
    buf[group.rank] = flat
    group.all_reduce(buf)
    return [r for rank in range(group.world_size) for r in _unflat(buf[rank], tensors, len(ids))]


def scatter_rows(caches: ModelCaches, group: TPGroup, kind: str, ids: list[int],
                 rows: list[torch.Tensor] | None = None) -> None:
    """Every rank runs this for one SCATTER_ROWS (rank 0 with `rows`: every rank's, rank-major);
    each writes its own rows into its pages `ids`."""
    tensors = local_page_tensors(caches, kind)
    per_rank = sum(_row_bytes(tensors)) * len(ids)
    if rows is not None:
        k = len(tensors)
        buf = torch.stack([_flat(rows[r * k : (r + 1) * k]).to(group.device) for r in range(group.world_size)])
    else:
        buf = torch.empty(group.world_size, per_rank, dtype=torch.uint8, device=group.device)
    group.broadcast(buf)
    mine = _unflat(buf[group.rank], tensors, len(ids))
    if not tensors:
        return
    index = torch.tensor(ids, dtype=torch.long, device=tensors[0].device)
    for t, r in zip(tensors, mine):
        t.index_copy_(0, index, r.to(t.device))
