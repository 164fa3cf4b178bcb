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

Over a channel (`send_prefix` / `recv_prefix`, see `workers.transfer_channel`) the payload is
streamed in chunks, pipelined on both sides, with the checksum in a trailer (below).
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
from workers.engine.page_tensors import page_tensors


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


def group_tensors(cache: EngineCacheManager, group: int) -> list[torch.Tensor]:
    """The page-indexed tensors a transfer moves for a group (`page_tensors.page_tensors`; the
    full group's sidecar always travels)."""
    return page_tensors(cache, group, sidecar=True)


def page_bytes(cache: EngineCacheManager) -> PageBytes:
    """What a transfer of an n-token hit moves, as a line in n (`cache_service.link_costs`): one
    page of each Mamba group, n / block_size pages of each attention group."""
    fixed, per_token = 0, 0.0
    for g, spec in enumerate(cache.layout.groups):
        nbytes = sum(t[0].numel() * t.element_size() for t in group_tensors(cache, g))
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
    cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int, tp_size: int = 1, tp_rank: int = 0
) -> tuple[TransferHeader, torch.Tensor]:
    """Pack the cached pages that serve a hit of `num_tokens` (must be cached here)."""
    if num_tokens <= 0 or num_tokens % cache.alignment:
        raise TransferError(f"transfer length {num_tokens} is not a positive multiple of {cache.alignment}")
    wanted = _wanted_keys(cache, hashes, num_tokens)
    blocks = pin_pages(cache, wanted, num_tokens)
    try:
        parts: list[torch.Tensor] = []  # tensor-major, page-minor: one gather per cache tensor
        for group, found in enumerate(blocks):
            index = torch.tensor([b.block_id for b in found], dtype=torch.long)
            parts.extend(t.index_select(0, index).reshape(-1) for t in group_tensors(cache, group))
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
    if payload.numel() != header.nbytes or checksum(payload) != header.checksum:
        raise TransferError("transfer payload failed its checksum")
    new = [[k for k in keys if bytes.fromhex(k) not in cache.pools[g].cached] for g, keys in enumerate(header.keys)]
    if not all(cache.pools[g].can_allocate(len(keys)) for g, keys in enumerate(new)):
        raise TransferError("no room in the destination pools")
    sample = cache.caches.kv[min(cache.caches.kv)][0]
    if str(sample.dtype) != header.dtype:
        raise TransferError(f"incompatible transfer: dtype {header.dtype}, here {sample.dtype}")
    values = payload.view(sample.dtype)
    expected = sum(len(keys) * t[0].numel() for g, keys in enumerate(header.keys) for t in group_tensors(cache, g))
    if values.numel() != expected:
        raise TransferError("transfer payload size does not match its pages")
    offset, stored = 0, 0
    for group, keys in enumerate(header.keys):
        pool = cache.pools[group]
        fresh = [i for i, k in enumerate(keys) if bytes.fromhex(k) not in pool.cached]
        pages = pool.allocate(len(fresh))
        rows = torch.tensor(fresh, dtype=torch.long)
        dst = torch.tensor([p.block_id for p in pages], dtype=torch.long)
        for t in group_tensors(cache, group):
            n = len(keys) * t[0].numel()
            if pages:
                t.index_copy_(0, dst, values[offset : offset + n].view(len(keys), *t.shape[1:]).index_select(0, rows))
            offset += n
        for i, page in zip(fresh, pages):
            pool.cache_block(page, BlockHash(bytes.fromhex(keys[i])))
        pool.free(pages)
        stored += len(pages)
    return stored


# ---- pipelined rank-to-rank transfer ------------------------------------------------------------
#
#   sender                                   receiver
#   sizes, header (keys + chunk sizes)  ->   check compatibility, allocate the fresh pages
#   (sizes [0, 0] instead: the pages are gone, nothing follows)
#   chunk 0 | chunk 1 | ... (pages of one    receive chunk k+1 while copying chunk k into its
#   cache tensor each, <= chunk_bytes)  ->   pages; checksum as they arrive
#   trailer: xxh3-64 of all chunks      ->   match: register the pages; else free them, raise
#
# Chunks are runs of consecutive pages sent straight from the cache tensors (no gather) and, when
# the destination pages are consecutive too, received straight into them. Every send and receive
# is posted at once, so the wire never waits on Python; pages are pinned (ref-counted) on
# the engine's loop thread for the duration, so eviction cannot recycle them mid-stream; copies
# run off the loop thread, and the engine keeps serving.

DEFAULT_CHUNK_BYTES = 4 * 2**20
ON_THIS_THREAD = lambda fn: fn()  # noqa: E731 - run on this thread (no engine loop)


def _runs(ids: list[int], limit: int) -> list[tuple[int, int]]:
    """Split rows [0, len(ids)) where block ids stop being consecutive, at most `limit` rows each."""
    runs, a = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1 or i - a >= limit:
            runs.append((a, i))
            a = i
    return runs


def _chunk_plan(cache: EngineCacheManager, ids: list[list[int]], chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """(group, tensor index, first row, end row) per chunk, in payload order. A chunk is a run of
    consecutive source pages of one cache tensor, so it is sent straight from the cache (no gather)."""
    plan = []
    for group, group_ids in enumerate(ids):
        for ti, t in enumerate(group_tensors(cache, group)):
            page_bytes = t[0].numel() * t.element_size()
            limit = max(1, chunk_bytes // max(page_bytes, 1))
            plan.extend((group, ti, a, b) for a, b in _runs(group_ids, limit))
    return plan


def rows_view(t: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
    """`t[ids]` as a zero-copy byte view when `ids` are consecutive, else None."""
    if t.is_contiguous() and ids and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return t[ids[0] : ids[-1] + 1].view(-1).view(torch.uint8)
    return None


def _chunk_nbytes(cache: EngineCacheManager, plan) -> list[int]:
    tensors = [group_tensors(cache, g) for g in range(len(cache.pools))]
    return [(b - a) * tensors[g][ti][0].numel() * tensors[g][ti].element_size() for g, ti, a, b in plan]


def _wanted_keys(cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int,
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


def send_prefix(cache: EngineCacheManager, hashes: RequestBlockHashes, num_tokens: int, channel,
                on_loop=ON_THIS_THREAD, chunk_bytes: int = DEFAULT_CHUNK_BYTES, tp_size: int = 1, tp_rank: int = 0,
                corrupt: bool = False, kv_only: bool = False) -> int:
    """Stream the pages serving a `num_tokens` hit to the channel's peer (`kv_only`: its attention
    blocks only, `_wanted_keys`). Returns payload bytes.

    `on_loop(fn)` runs `fn()` where the engine may be touched (an `EngineRunner.call`). `corrupt`
    (fault injection) flips one byte of the first chunk on the wire, after it was checksummed."""
    if num_tokens <= 0 or num_tokens % cache.alignment:
        raise TransferError(f"transfer length {num_tokens} is not a positive multiple of {cache.alignment}")

    def pin():
        wanted = _wanted_keys(cache, hashes, num_tokens, kv_only)
        return wanted, pin_pages(cache, wanted, num_tokens)

    try:
        wanted, blocks = on_loop(pin)
    except TransferError:
        channel.isend(torch.zeros(2, dtype=torch.int64)).wait()  # "nothing follows": the receiver stops
        raise
    try:
        ids = [[b.block_id for b in found] for found in blocks]
        plan = _chunk_plan(cache, ids, chunk_bytes)
        sizes = _chunk_nbytes(cache, plan)
        dtype = str(next(iter(cache.caches.kv.values()))[0].dtype)
        header = TransferHeader(
            cache.config.model_fingerprint, dtype, tp_size, tp_rank, cache.block_size,
            cache.config.mamba_block_size, num_tokens, tuple(tuple(k.hex() for k in keys) for keys in wanted),
            sum(sizes), "trailer", tuple(sizes),
        )
        raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        channel.isend(torch.tensor([raw.numel(), header.nbytes], dtype=torch.int64)).wait()
        channel.isend(raw).wait()
        tensors = [group_tensors(cache, g) for g in range(len(cache.pools))]
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


__all__ = ["TransferError", "TransferHeader", "export_prefix", "import_prefix", "send_prefix"]
