"""State-page transfer between replicas over torch.distributed (NCCL on GPU, gloo on CPU).

Two forms of the same content. In memory (`export_prefix` / `import_prefix`), a prefix of L
tokens (L a multiple of the alignment) is one header + one payload:

    header   length-prefixed JSON (`TransferHeader`): model fingerprint, dtype, TP layout,
             block sizes, the prefix keys per group, payload size and xxh3-64 checksum
    payload  one contiguous byte buffer: target KV blocks + sidecar rows, the Mamba state page
             at L, the draft-layer KV blocks

The receiver checks compatibility and the checksum, then registers the pages in its own pools
under the same prefix keys; the request that follows is a normal local hit. Any failure raises
`TransferError` with the reason, so the caller falls back to recompute and logs why.

Over a channel (`workers.transfer_channel`) the payload is streamed in chunks, pipelined on both
sides, with the checksum in a trailer: `transfer_send.send_prefix` and `transfer_recv.recv_prefix`,
which share the header, the page choice and pinning below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import torch
import xxhash

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.link_costs import PageBytes
from cache_service.promotion import pin_keys
from workers.engine.cache_manager import EngineCacheManager
from workers.engine.page_tensors import read_rows, row_specs, write_rows
from workers.transfer_rows import (
    cache_dtype,
    group_tensors,  # noqa: F401 - re-exported (bench/gpu_check_measure.py)
    sender_tp_size,
    tp_size_of,
    wire_row_bytes,
)


class TransferError(RuntimeError):
    """The transfer cannot be used (incompatible, corrupt, no room); recompute instead."""


@dataclass(frozen=True)
class TransferHeader:
    model_fingerprint: str
    dtype: str
    tp_size: int
    tp_rank: int
    kv_block_size: int
    mamba_block_size: int
    num_tokens: int
    keys: tuple[tuple[str, ...], ...]  # per group, hex prefix keys of the pages in payload order
    nbytes: int
    checksum: str  # xxh3-64 of the payload ("trailer": sent after the streamed chunks)
    chunks: tuple[int, ...] = ()  # streamed chunk sizes in bytes (empty for an in-memory payload)

    def encode(self) -> bytes:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}).encode()  # no deep copy

    @classmethod
    def decode(cls, raw: bytes) -> TransferHeader:
        data = json.loads(raw)
        data["keys"] = tuple(tuple(k) for k in data["keys"])
        data["chunks"] = tuple(data.get("chunks", ()))
        return cls(**data)


def page_bytes(cache: EngineCacheManager) -> PageBytes:
    """What a transfer of an n-token hit moves, as a line in n (`cache_service.link_costs`): one
    page of each Mamba group, n / block_size pages of each attention group; every rank's shard of
    a page counted at TP > 1 (what crosses the wire)."""
    fixed, per_token = 0, 0.0
    for g, spec in enumerate(cache.layout.groups):
        nbytes = sum(wire_row_bytes(cache, g))
        if spec.kind == "mamba":
            fixed += nbytes
        else:
            per_token += nbytes / cache.block_size
    return PageBytes(fixed, per_token)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes for the checksum (a host copy when the pages live on a GPU)."""
    return memoryview((t if t.device.type == "cpu" else t.cpu()).numpy())


def checksum(payload: torch.Tensor) -> str:
    """xxh3-64 (hex) of a tensor's bytes."""
    return xxhash.xxh3_64_hexdigest(host_bytes(payload))


def export_prefix(
    cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int, tp_size: int | None = None,
    tp_rank: int = 0,
) -> tuple[TransferHeader, torch.Tensor]:
    """Pack the cached pages that serve a hit of `num_tokens` (must be cached here); every rank's
    shard at TP > 1 (`workers.transfer_rows`), where it must run on the engine's loop thread.
    `tp_size`: the engine's (the default)."""
    tp_size = sender_tp_size(cache, tp_size)
    if num_tokens <= 0 or num_tokens % cache.alignment:
        raise TransferError(f"transfer length {num_tokens} is not a positive multiple of {cache.alignment}")
    wanted = wanted_keys(cache, hashes, num_tokens)
    blocks = pin_pages(cache, wanted, num_tokens)
    try:
        parts: list[torch.Tensor] = []  # tensor-major, page-minor: one gather per cache tensor
        for group, found in enumerate(blocks):
            if found:
                rows = read_rows(cache, group, [b.block_id for b in found], sidecar=True)
                parts.extend(r.reshape(-1) for r in rows)
    finally:
        for group, found in enumerate(blocks):
            cache.pools[group].free(found)
    payload = torch.cat(parts).contiguous().view(torch.uint8)
    header = TransferHeader(
        cache.config.model_fingerprint, str(parts[0].dtype), tp_size, tp_rank, cache.block_size,
        cache.config.mamba_block_size, num_tokens, tuple(tuple(k.hex() for k in keys) for keys in wanted),
        payload.numel(), checksum(payload),
    )
    return header, payload


def import_prefix(
    cache: EngineCacheManager, header: TransferHeader, payload: torch.Tensor, tp_size: int | None = None,
    tp_rank: int = 0,
) -> int:
    """Register received pages in this replica's pools. Returns the number of pages stored. At
    TP > 1 it writes every rank's shard, so it must run on the engine's loop thread. `tp_size`:
    the TP size the sender must have had (default: this engine's)."""
    expect = {
        "model_fingerprint": cache.config.model_fingerprint,
        "tp_size": tp_size_of(cache) if tp_size is None else tp_size, "tp_rank": tp_rank,
        "kv_block_size": cache.block_size, "mamba_block_size": cache.config.mamba_block_size,
    }
    for name, value in expect.items():
        if getattr(header, name) != value:
            raise TransferError(f"incompatible transfer: {name} is {getattr(header, name)!r}, here {value!r}")
    if len(header.keys) != len(cache.pools):
        raise TransferError(f"incompatible transfer: {len(header.keys)} groups, here {len(cache.pools)}")
    if payload.numel() != header.nbytes or checksum(payload) != header.checksum:
        raise TransferError("transfer payload failed its checksum")
    new = [[k for k in keys if bytes.fromhex(k) not in cache.pools[g].cached] for g, keys in enumerate(header.keys)]
    if not all(cache.pools[g].can_allocate(len(keys)) for g, keys in enumerate(new)):
        raise TransferError("no room in the destination pools")
    if cache_dtype(cache) != header.dtype:
        raise TransferError(f"incompatible transfer: dtype {header.dtype}, here {cache_dtype(cache)}")
    expected = sum(len(keys) * n for g, keys in enumerate(header.keys) for n in wire_row_bytes(cache, g))
    if payload.numel() != expected:
        raise TransferError("transfer payload size does not match its pages")
    offset, stored = 0, 0
    for group, keys in enumerate(header.keys):
        pool = cache.pools[group]
        fresh = [i for i, k in enumerate(keys) if bytes.fromhex(k) not in pool.cached]
        pages = pool.allocate(len(fresh))
        try:
            rows = torch.tensor(fresh, dtype=torch.long)
            picked = []
            for nbytes, (dtype, shape) in zip(wire_row_bytes(cache, group), row_specs(cache, group, sidecar=True)):
                n = len(keys) * nbytes
                picked.append(payload[offset : offset + n].view(dtype).view(len(keys), *shape).index_select(0, rows))
                offset += n
            if pages:
                write_rows(cache, group, [p.block_id for p in pages], picked, sidecar=True)
            for i, page in zip(fresh, pages):
                pool.cache_block(page, BlockHash(bytes.fromhex(keys[i])))
        finally:
            pool.free(pages)
        stored += len(pages)
    return stored


# ---- shared by both ends of a streamed transfer -------------------------------------------------

ON_THIS_THREAD = lambda fn: fn()  # noqa: E731 - run on this thread (no engine loop)


def rows_view(t: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
    """`t[ids]` as a zero-copy byte view when `ids` are consecutive, else None."""
    if t.is_contiguous() and ids and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return t[ids[0] : ids[-1] + 1].view(-1).view(torch.uint8)
    return None


def wanted_keys(cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int,
                kv_only: bool = False) -> list[list[BlockHash]]:
    """Per group, the keys of the pages serving a `num_tokens` hit (a dropping group's, under EAGLE
    drop, reach past it: the pages that prove the successor token). `kv_only`: the attention
    groups' blocks of the first `num_tokens` tokens only, no Mamba page (a prompt still
    prefilling, sent ahead of its hand-off: `handoff_import` shares KV without a state)."""
    size = cache.block_size
    reach = [num_tokens if kv_only else cache.coordinator.serving_extent(g, num_tokens)
             for g in range(len(cache.pools))]
    return [
        ([] if kv_only else [hashes.prefix_hash(num_tokens)]) if cache.layout.groups[g].kind == "mamba"
        else [hashes.prefix_hash(e) for e in range(size, reach[g] + 1, size)]
        for g in range(len(cache.pools))
    ]


def pin_pages(cache: EngineCacheManager, wanted: list[list[BlockHash]], num_tokens: int) -> list[list]:
    """Per group, a held reference on the device page of every wanted key (pages only the host
    tier holds are promoted first: a transfer is served from the holder's host tier too); on the
    engine's thread. Release with each pool's `free`."""
    blocks: list[list] = []
    for group, keys in enumerate(wanted):
        found = pin_keys(cache.pools[group], keys)
        if found is None:
            for g, held in enumerate(blocks):
                cache.pools[g].free(held)
            raise TransferError(f"group {group}: page for the {num_tokens}-token prefix is not cached")
        blocks.append(found)
    return blocks


__all__ = ["TransferError", "TransferHeader", "export_prefix", "import_prefix"]
