"""State-page transfer between replicas over torch.distributed (NCCL on GPU, gloo on CPU).

A prefix of L tokens (L a multiple of the alignment) moves as one message, rank to rank:

    header   length-prefixed JSON (`TransferHeader`): model fingerprint, dtype, TP layout,
             block sizes, the prefix keys per group, payload size and xxh3-64 checksum
    payload  one contiguous byte buffer: target KV blocks + sidecar rows, the Mamba state page
             at L, the draft-layer KV blocks

The receiver checks compatibility and the checksum, then registers the pages in its own pools
under the same prefix keys; the request that follows is a normal local hit. Any failure raises
`TransferError` with the reason, so the caller falls back to recompute and logs why.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import xxhash

from cache_service.block_hash import BlockHash, RequestBlockHashes
from workers.engine.cache_manager import FULL, MAMBA, EngineCacheManager


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
    checksum: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TransferHeader:
        data = json.loads(raw)
        data["keys"] = tuple(tuple(k) for k in data["keys"])
        return cls(**data)


def _group_tensors(cache: EngineCacheManager, group: int) -> list[torch.Tensor]:
    """The page-indexed tensors of a group ([num_pages, ...] each), in a fixed order."""
    caches = cache.caches
    if group == FULL:
        return [t for layer in sorted(caches.kv) for t in caches.kv[layer]] + [cache.sidecar]
    if group == MAMBA:
        return [caches.conv[layer] for layer in sorted(caches.conv)] + [
            caches.ssm[layer] for layer in sorted(caches.ssm)
        ]
    return [t for layer in sorted(caches.draft_kv) for t in caches.draft_kv[layer]]


def _checksum(payload: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(payload.numpy()))


def export_prefix(
    cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int, tp_size: int = 1, tp_rank: int = 0
) -> tuple[TransferHeader, torch.Tensor]:
    """Pack the cached pages that serve a hit of `num_tokens` (must be cached here)."""
    size = cache.block_size
    if num_tokens <= 0 or num_tokens % cache.alignment:
        raise TransferError(f"transfer length {num_tokens} is not a positive multiple of {cache.alignment}")
    # a dropping group (EAGLE drop) serves L only with its pages through L + A
    reach = [num_tokens + (cache.alignment if g in cache.coordinator.dropping_groups else 0)
             for g in range(len(cache.pools))]
    wanted: list[list[BlockHash]] = [
        [hashes.prefix_hash(num_tokens)] if g == MAMBA
        else [hashes.prefix_hash(e) for e in range(size, reach[g] + 1, size)]
        for g in range(len(cache.pools))
    ]
    parts: list[torch.Tensor] = []  # tensor-major, page-minor: one gather per cache tensor
    for group, keys in enumerate(wanted):
        ids = []
        for key in keys:
            block = cache.pools[group].get_cached(key)
            if block is None:
                raise TransferError(f"group {group}: page for the {num_tokens}-token prefix is not cached")
            ids.append(block.block_id)
        index = torch.tensor(ids, dtype=torch.long)
        parts.extend(t.index_select(0, index).reshape(-1) for t in _group_tensors(cache, group))
    payload = torch.cat(parts).contiguous().view(torch.uint8)
    header = TransferHeader(
        cache.config.model_fingerprint, str(parts[0].dtype), tp_size, tp_rank, cache.block_size,
        cache.config.mamba_block_size, num_tokens, tuple(tuple(k.hex() for k in keys) for keys in wanted),
        payload.numel(), _checksum(payload),
    )
    return header, payload


def import_prefix(
    cache: EngineCacheManager, header: TransferHeader, payload: torch.Tensor, tp_size: int = 1, tp_rank: int = 0
) -> int:
    """Register received pages in this replica's pools. Returns the number of pages stored."""
    expect = {
        "model_fingerprint": cache.config.model_fingerprint, "tp_size": tp_size, "tp_rank": tp_rank,
        "kv_block_size": cache.block_size, "mamba_block_size": cache.config.mamba_block_size,
    }
    for name, value in expect.items():
        if getattr(header, name) != value:
            raise TransferError(f"incompatible transfer: {name} is {getattr(header, name)!r}, here {value!r}")
    if len(header.keys) != len(cache.pools):
        raise TransferError(f"incompatible transfer: {len(header.keys)} groups, here {len(cache.pools)}")
    if payload.numel() != header.nbytes or _checksum(payload) != header.checksum:
        raise TransferError("transfer payload failed its checksum")
    new = [[k for k in keys if bytes.fromhex(k) not in cache.pools[g].cached] for g, keys in enumerate(header.keys)]
    if not all(cache.pools[g].can_allocate(len(keys)) for g, keys in enumerate(new)):
        raise TransferError("no room in the destination pools")
    sample = cache.caches.kv[min(cache.caches.kv)][0]
    if str(sample.dtype) != header.dtype:
        raise TransferError(f"incompatible transfer: dtype {header.dtype}, here {sample.dtype}")
    values = payload.view(sample.dtype)
    expected = sum(len(keys) * t[0].numel() for g, keys in enumerate(header.keys) for t in _group_tensors(cache, g))
    if values.numel() != expected:
        raise TransferError("transfer payload size does not match its pages")
    offset, stored = 0, 0
    for group, keys in enumerate(header.keys):
        pool = cache.pools[group]
        fresh = [i for i, k in enumerate(keys) if bytes.fromhex(k) not in pool.cached]
        pages = pool.allocate(len(fresh))
        rows = torch.tensor(fresh, dtype=torch.long)
        dst = torch.tensor([p.block_id for p in pages], dtype=torch.long)
        for t in _group_tensors(cache, group):
            n = len(keys) * t[0].numel()
            if pages:
                t.index_copy_(0, dst, values[offset : offset + n].view(len(keys), *t.shape[1:]).index_select(0, rows))
            offset += n
        for i, page in zip(fresh, pages):
            pool.cache_block(page, BlockHash(bytes.fromhex(keys[i])))
        pool.free(pages)
        stored += len(pages)
    return stored


def send_prefix(header: TransferHeader, payload: torch.Tensor, dst: int, group=None) -> None:
    raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel(), payload.numel()], dtype=torch.int64), dst, group=group)
    dist.send(raw, dst, group=group)
    dist.send(payload, dst, group=group)


def recv_prefix(src: int, group=None) -> tuple[TransferHeader, torch.Tensor]:
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group)
    raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return TransferHeader.decode(raw.numpy().tobytes()), payload


__all__ = ["TransferError", "TransferHeader", "export_prefix", "import_prefix", "recv_prefix", "send_prefix"]
