"""Streaming a prefix's pages to a peer over a pair channel: the sending end (`transfer_recv.py`
is the receiving one; the in-memory form, the header and the page choice are `workers.transfer`'s).

  sender                                   receiver
  sizes, header (keys + chunk sizes)  ->   check compatibility, allocate the fresh pages
  (sizes [0, 0] instead: the pages are gone, nothing follows)
  chunk 0 | chunk 1 | ... (pages of one    receive chunk k+1 while copying chunk k into its
  cache tensor each, <= chunk_bytes)  ->   pages; checksum as they arrive
  trailer: xxh3-64 of all chunks      ->   match: register the pages; else free them, raise

At TP 1 chunks are runs of consecutive pages sent straight from the cache tensors (no gather)
and, when the destination pages are consecutive too, received straight into them; at TP > 1
they are cut from copies of every rank's rows, gathered on the loop thread, and received into
staging tensors (`workers/transfer_rows.py`). Every send and receive is posted at once, so
the wire never waits on Python; pages are pinned (ref-counted) on the engine's loop thread for
the duration, so eviction cannot recycle them mid-stream; copies run off the loop thread, and
the engine keeps serving.
"""

from __future__ import annotations

import torch
import xxhash

from cache_service.block_hash import RequestBlockHashes
from workers.engine.cache_manager import EngineCacheManager
from workers.transfer import (
    ON_THIS_THREAD,
    TransferError,
    TransferHeader,
    host_bytes,
    pin_pages,
    rows_view,
    wanted_keys,
)
from workers.transfer_rows import cache_dtype, send_sources, sender_tp_size

DEFAULT_CHUNK_BYTES = 4 * 2**20


def _runs(ids: list[int], limit: int) -> list[tuple[int, int]]:
    """Split rows [0, len(ids)) where block ids stop being consecutive, at most `limit` rows each."""
    runs, a = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1 or i - a >= limit:
            runs.append((a, i))
            a = i
    return runs


def _chunk_plan(tensors: list[list[torch.Tensor]], ids: list[list[int]],
                chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """(group, tensor index, first row, end row) per chunk, in payload order. A chunk is a run of
    consecutive rows of one source tensor (`transfer_rows.send_sources`), so it is sent straight
    from it (no gather)."""
    plan = []
    for group, group_ids in enumerate(ids):
        for ti, t in enumerate(tensors[group]):
            page_bytes = t[0].numel() * t.element_size() if len(t) else 1  # an empty group has no runs
            limit = max(1, chunk_bytes // max(page_bytes, 1))
            plan.extend((group, ti, a, b) for a, b in _runs(group_ids, limit))
    return plan


def _chunk_nbytes(tensors: list[list[torch.Tensor]], plan) -> list[int]:
    return [(b - a) * tensors[g][ti][0].numel() * tensors[g][ti].element_size() for g, ti, a, b in plan]


def send_prefix(cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int, channel,
                on_loop=ON_THIS_THREAD, chunk_bytes: int = DEFAULT_CHUNK_BYTES, tp_size: int | None = None,
                tp_rank: int = 0, corrupt: bool = False, kv_only: bool = False) -> int:
    """Stream the pages serving a `num_tokens` hit to the channel's peer (`kv_only`: its attention
    blocks only, `workers.transfer.wanted_keys`). Returns payload bytes.

    `on_loop(fn)` runs `fn()` where the engine may be touched (an `EngineRunner.call`; at TP > 1
    the engine's loop thread, which issues the gather of every rank's rows). `tp_size`: the
    engine's (the default; the header carries it). `corrupt` (fault injection) flips one byte of
    the first chunk on the wire, after it was checksummed."""
    tp_size = sender_tp_size(cache, tp_size)
    if num_tokens <= 0 or num_tokens % cache.alignment:
        raise TransferError(f"transfer length {num_tokens} is not a positive multiple of {cache.alignment}")

    def pin():
        wanted = wanted_keys(cache, hashes, num_tokens, kv_only)
        blocks = pin_pages(cache, wanted, num_tokens)
        try:
            return wanted, blocks, *send_sources(cache, [[b.block_id for b in found] for found in blocks])
        except BaseException:
            for g, found in enumerate(blocks):
                cache.pools[g].free(found)
            raise

    try:
        wanted, blocks, tensors, ids = on_loop(pin)
    except TransferError:
        channel.isend(torch.zeros(2, dtype=torch.int64)).wait()  # "nothing follows": the receiver stops
        raise
    try:
        plan = _chunk_plan(tensors, ids, chunk_bytes)
        sizes = _chunk_nbytes(tensors, plan)
        dtype = cache_dtype(cache)
        header = TransferHeader(
            cache.config.model_fingerprint, dtype, tp_size, tp_rank, cache.block_size,
            cache.config.mamba_block_size, num_tokens, tuple(tuple(k.hex() for k in keys) for keys in wanted),
            sum(sizes), "trailer", tuple(sizes),
        )
        raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        channel.isend(torch.tensor([raw.numel(), header.nbytes], dtype=torch.int64)).wait()
        channel.isend(raw).wait()
        digest = xxhash.xxh3_64()
        in_flight: list = []
        chunks: list[torch.Tensor] = []
        for group, ti, a, b in plan:
            t, rows = tensors[group][ti], ids[group][a:b]
            chunk = rows_view(t, rows)  # runs are consecutive by construction: no gather
            if chunk is None:
                chunk = t.index_select(0, torch.tensor(rows, dtype=torch.long)).view(-1).view(torch.uint8)
            chunks.append(chunk)
            if corrupt:  # a copy: the cached page itself stays intact
                chunk, corrupt = chunk.clone(), False
                chunk[0] ^= 0xFF
            in_flight.append(channel.isend(chunk))  # all posted at once: the wire never waits on us
        for chunk in chunks:  # checksummed while the sends are on the wire (pages are pinned)
            digest.update(host_bytes(chunk))
        for work in in_flight:
            work.wait()
        trailer = torch.frombuffer(bytearray(digest.hexdigest().encode()), dtype=torch.uint8)
        channel.isend(trailer).wait()
        return header.nbytes
    finally:
        on_loop(lambda: [cache.pools[g].free(found) for g, found in enumerate(blocks)])


__all__ = ["DEFAULT_CHUNK_BYTES", "send_prefix"]
