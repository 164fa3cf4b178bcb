"""Where a transferred group's page rows come from and where they land (the streamed ends,
`transfer_send.py` / `transfer_recv.py`, and the in-memory form, `workers.transfer`).

    TP 1   the cache tensors themselves (`group_tensors`): a run of consecutive pages is sent
           straight from them and received straight into them (zero copy)
    TP n   copies. The sender gathers every rank's rows of the wanted pages on the engine loop
           (`page_tensors.read_rows`: rank 0's tensors, rank 1's, ..., then the sidecar) and
           streams those; the receiver lands the chunks in staging tensors and, on the engine
           loop at registration, scatters the fresh pages' rows to every rank (`write_rows`)

On the wire a group is its `row_specs(..., sidecar=True)` tensors in order, each one's rows in
page order. At TP 1 that list is `group_tensors`' own, so the TP 1 byte layout is the same
whether or not the engine could shard. TP commands (the gather, the scatter) must be issued on
the engine's loop thread: rank 0 owns the TP group.
"""

from __future__ import annotations

import math

import torch

from workers.engine.page_tensors import page_tensors, read_rows, row_specs, tp_size_of, write_rows


def group_tensors(cache, group: int) -> list[torch.Tensor]:
    """The page-indexed tensors a TP 1 transfer moves for a group (`page_tensors.page_tensors`;
    the full group's sidecar always travels)."""
    return page_tensors(cache, group, sidecar=True)


def sender_tp_size(cache, tp_size: int | None) -> int:
    """The TP size a sender writes in its header: the engine's (`tp_size`, if given, must match it:
    the header describes the layout on the wire)."""
    here = tp_size_of(cache)
    if tp_size is not None and tp_size != here:
        raise ValueError(f"tp_size {tp_size} given for an engine of TP size {here}")
    return here


def cache_dtype(cache) -> str:
    """The dtype of the cache's page tensors, as a header names it."""
    caches = getattr(cache.caches, "local", cache.caches)
    return str(next(iter(caches.kv.values()))[0].dtype)


def wire_row_bytes(cache, group: int) -> list[int]:
    """Bytes of one page's row of each tensor that travels for the group, in wire order (every
    rank's shard counted)."""
    return [math.prod(shape) * dtype.itemsize for dtype, shape in row_specs(cache, group, sidecar=True)]


def send_sources(cache, ids: list[list[int]]) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Per group, the tensors a sender cuts its chunks from and the rows of the wanted pages in
    them (`ids`: their block ids). TP 1: the cache tensors and `ids`; TP n: gathered copies (rows
    0..n-1), so on the engine loop, with the pages pinned."""
    if tp_size_of(cache) == 1:
        return [group_tensors(cache, g) for g in range(len(ids))], ids
    tensors = [list(read_rows(cache, g, group_ids, sidecar=True)) if group_ids else _empty(cache, g, 0)
               for g, group_ids in enumerate(ids)]
    return tensors, [list(range(len(group_ids))) for group_ids in ids]


def staging_tensors(cache, counts: list[int]) -> list[list[torch.Tensor]]:
    """Per group, empty tensors (wire order) for `counts[g]` received pages of a TP n engine."""
    return [_empty(cache, g, n) for g, n in enumerate(counts)]


def write_staged(cache, staged: list[list[torch.Tensor]], fresh: list[list[int]], pages: list[list]) -> int:
    """On the engine loop: write the staged rows `fresh[g]` of each group into its `pages[g]`
    (every rank's shard, the sidecar). Returns bytes written."""
    written = 0
    for group, (rows, pg) in enumerate(zip(fresh, pages)):
        if pg:
            index = torch.tensor(rows, dtype=torch.long, device=cache.sidecar.device)
            picked = [t.index_select(0, index) for t in staged[group]]
            written += write_rows(cache, group, [p.block_id for p in pg], picked, sidecar=True)
    return written


def _empty(cache, group: int, num_rows: int) -> list[torch.Tensor]:
    device = cache.sidecar.device
    return [torch.empty(num_rows, *shape, dtype=dtype, device=device)
            for dtype, shape in row_specs(cache, group, sidecar=True)]


__all__ = ["cache_dtype", "group_tensors", "send_sources", "sender_tp_size", "staging_tensors", "tp_size_of",
           "wire_row_bytes", "write_staged"]
