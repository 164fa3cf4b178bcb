"""Receiving a streamed prefix (the other end of `workers.transfer_send.send_prefix`): read the header,
check it and allocate fresh pages on the engine loop, land each chunk in its pages (in place
when the rows are a run), verify the checksum, then register the pages under their hashes. A
refused transfer is drained whole, so the pair channel stays usable. At TP > 1 the chunks land
in staging tensors and registration first writes the fresh pages' rows to every rank
(`workers/transfer_rows.py`).
"""

from __future__ import annotations

import torch
import xxhash

from cache_service.block_hash import BlockHash
from workers.engine.cache_manager import EngineCacheManager
from workers.transfer import ON_THIS_THREAD, TransferError, TransferHeader, host_bytes, rows_view
from workers.transfer_rows import cache_dtype, group_tensors, staging_tensors, tp_size_of, wire_row_bytes, write_staged

__all__ = ["recv_prefix"]


def recv_prefix(cache: EngineCacheManager, channel, on_loop=ON_THIS_THREAD, tp_size: int | None = None,
                tp_rank: int = 0) -> int:
    """Receive a streamed prefix and register its pages. Returns pages stored; `TransferError` if refused
    (the whole stream is still drained, so the channel stays usable). `on_loop` as for `send_prefix`
    (at TP > 1 it issues the write to every rank); `tp_size`: the TP size the sender must have
    (default: this engine's)."""
    tp_size = tp_size_of(cache) if tp_size is None else tp_size
    header = _recv_header(channel)
    prepared = on_loop(lambda: _prepare_receive(cache, header, tp_size, tp_rank))
    landing = _Landing(cache, header, prepared)
    posted = []  # every receive posted up front; chunk k is absorbed while k+1.. are arriving
    for k, nbytes in enumerate(header.chunks):
        buf, in_place = landing.target(k, nbytes)
        posted.append((k, buf, in_place, channel.irecv(buf)))
    for k, buf, in_place, work in posted:
        work.wait()
        landing.absorb(k, buf, in_place)
    trailer = torch.empty(16, dtype=torch.uint8)
    channel.irecv(trailer).wait()
    if landing.error is None and trailer.numpy().tobytes().decode() != landing.digest.hexdigest():
        landing.error = "transfer payload failed its checksum"
    stored = on_loop(landing.register)
    if landing.error is not None:
        raise TransferError(landing.error)
    return stored


def _recv_header(channel) -> TransferHeader:
    sizes = torch.empty(2, dtype=torch.int64)
    channel.irecv(sizes).wait()
    if int(sizes[0]) == 0:
        raise TransferError("the sender no longer holds the prefix (evicted)")
    raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
    channel.irecv(raw).wait()
    return TransferHeader.decode(raw.numpy().tobytes())


def _prepare_receive(cache: EngineCacheManager, header: TransferHeader, tp_size: int, tp_rank: int):
    """On the engine loop: why the transfer is refused (a str), or (plan, fresh rows, their pages)."""
    expect = {
        "model_fingerprint": cache.config.model_fingerprint, "tp_size": tp_size, "tp_rank": tp_rank,
        "kv_block_size": cache.block_size, "mamba_block_size": cache.config.mamba_block_size,
        "dtype": cache_dtype(cache),
    }
    for name, value in expect.items():
        if getattr(header, name) != value:
            return f"incompatible transfer: {name} is {getattr(header, name)!r}, here {value!r}"
    if len(header.keys) != len(cache.pools):
        return f"incompatible transfer: {len(header.keys)} groups, here {len(cache.pools)}"
    plan = _plan_from_sizes(cache, [len(k) for k in header.keys], header.chunks)
    if plan is None:
        return "transfer chunk sizes do not match this replica's pages"
    fresh = [[i for i, k in enumerate(keys) if bytes.fromhex(k) not in cache.pools[g].cached]
             for g, keys in enumerate(header.keys)]
    if not all(cache.pools[g].can_allocate(len(rows)) for g, rows in enumerate(fresh)):
        return "no room in the destination pools"
    # ascending block ids: consecutive free pages make runs that are received in place, no copy
    pages = [sorted(cache.pools[g].allocate(len(rows)), key=lambda p: p.block_id) for g, rows in enumerate(fresh)]
    return plan, fresh, pages


class _Landing:
    """Where a received prefix's chunks land (TP 1: its fresh pages, in place when the rows are a
    run; TP n: staging tensors, every row in place), the running checksum, and registering the
    pages at the end; a refused transfer (`error`) is drained into throwaway buffers."""

    def __init__(self, cache: EngineCacheManager, header: TransferHeader, prepared) -> None:
        self.cache = cache
        self.header = header
        self.error: str | None = prepared if isinstance(prepared, str) else None
        self.plan, self.fresh, self.pages = (None, None, None) if self.error is not None else prepared
        self.staged = tp_size_of(cache) > 1
        self.tensors: list[list[torch.Tensor]] = []  # per group, the tensors chunks land in (wire order)
        self.dst_of: list[dict[int, int]] = []  # per group: page row -> its row in `tensors` (rows kept)
        if self.error is None and self.staged:
            counts = [len(keys) for keys in header.keys]
            self.tensors = staging_tensors(cache, counts)
            self.dst_of = [{i: i for i in range(n)} for n in counts]
        elif self.error is None:
            self.tensors = [group_tensors(cache, g) for g in range(len(cache.pools))]
            self.dst_of = [dict(zip(rows, (p.block_id for p in pg))) for rows, pg in zip(self.fresh, self.pages)]
        self.digest = xxhash.xxh3_64()

    def target(self, k: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        """Where chunk k lands: straight into its destination pages if possible, else a buffer."""
        if self.error is not None:
            return torch.empty(nbytes, dtype=torch.uint8), False  # drained and dropped
        group, ti, a, b = self.plan[k]
        dst = [self.dst_of[group].get(i) for i in range(a, b)]
        if None not in dst:
            view = rows_view(self.tensors[group][ti], dst)
            if view is not None:
                return view, True
        return torch.empty(nbytes, dtype=torch.uint8, device=self.tensors[group][ti].device), False  # beside

    def absorb(self, k: int, buf: torch.Tensor, in_place: bool) -> None:
        self.digest.update(host_bytes(buf))
        if self.error is not None or in_place:
            return
        group, ti, a, b = self.plan[k]
        t = self.tensors[group][ti]
        rows = [i for i in range(a, b) if i in self.dst_of[group]]
        if rows:
            data = buf.view(t.dtype).view(b - a, *t.shape[1:])
            src = torch.tensor([i - a for i in rows], dtype=torch.long)
            dst = torch.tensor([self.dst_of[group][i] for i in rows], dtype=torch.long)
            t.index_copy_(0, dst, data.index_select(0, src))

    def register(self) -> int:
        """On the engine loop: write staged rows to every rank (TP n), cache the received pages under
        their hashes (none if refused), then drop this transfer's references. Returns pages stored."""
        stored, ok = 0, False
        try:
            if self.error is None and self.staged:
                write_staged(self.cache, self.tensors, self.fresh, self.pages)
            ok = self.error is None
        finally:
            for group, pg in enumerate(self.pages or []):
                if ok:
                    for row, page in zip(self.fresh[group], pg):
                        key = BlockHash(bytes.fromhex(self.header.keys[group][row]))
                        self.cache.pools[group].cache_block(page, key)
                    stored += len(pg)
                self.cache.pools[group].free(pg)
        return stored


def _plan_from_sizes(cache: EngineCacheManager, counts: list[int], chunks: tuple[int, ...]):
    """Recover the sender's chunk plan (rows per chunk) from its chunk sizes."""
    plan, k = [], 0
    for group, count in enumerate(counts):
        for ti, page_bytes in enumerate(wire_row_bytes(cache, group)):
            a = 0
            while a < count:
                if k >= len(chunks) or chunks[k] % page_bytes:
                    return None
                b = a + chunks[k] // page_bytes
                plan.append((group, ti, a, b))
                a, k = b, k + 1
            if a != count:
                return None
    return plan if k == len(chunks) else None
