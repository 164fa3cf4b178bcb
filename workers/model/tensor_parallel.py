"""Tensor parallelism: rank 0's `TPModel` proxy and the command loop of ranks 1..n-1.

Rank 0 runs the LLMEngine unchanged; its model is a `TPModel` with HybridForCausalLM's interface.
Every call that touches weights or caches is broadcast to the other ranks as a small command
(`tp_commands.py`: the commands, what call sends each, their wire format), then every rank runs it
on its own shard (tp_shard.py) and its own shard of the caches; the row-parallel layers all-reduce
inside the forward, so all ranks hold the same full hidden states. `model.compute_logits(h)` runs on
rank 0 only: it alone holds lm_head.

Block and slot ids are rank 0's (its cache manager owns them) and mean the same page on every rank.
Rank 0 validates a batch before sending it, so a bad batch raises there without desynchronising the
group; a failure after the broadcast (e.g. out of memory on one rank) leaves the replica unusable:
close it.
"""

from __future__ import annotations

import logging

import torch

from workers.model.caches import ModelCaches
from workers.model.config import HybridModelConfig
from workers.model.forward_batch import ForwardBatch, ForwardCounts
from workers.model.hybrid import HybridForCausalLM
from workers.model.tp_commands import (
    TPCommand,
    decode_batch,
    encode_batch,
    gather_forward_counts,
    recv_command,
    send_command,
)
from workers.model.tp_group import TPGroup
from workers.model.tp_pages import KINDS, gather_rows, scatter_rows

log = logging.getLogger(__name__)


class _MirroredPage:
    """`pool[i]` of a draft KV tensor on rank 0: `dst.copy_(src)` copies the page on every rank."""

    def __init__(self, pool: _MirroredPool, index: int) -> None:
        self.pool, self.index = pool, index

    def copy_(self, src: _MirroredPage) -> None:
        p = self.pool
        p.caches.model.send(TPCommand.COPY_DRAFT_PAGE, [p.layer, p.which, int(src.index), int(self.index)])
        p.tensor[self.index].copy_(p.tensor[src.index])


class _MirroredPool:
    def __init__(self, caches: TPCaches, layer: int, which: int) -> None:
        self.caches, self.layer, self.which = caches, layer, which
        self.tensor = caches.local.draft_kv[layer][which]
        self.shape = self.tensor.shape

    def __getitem__(self, index: int) -> _MirroredPage:
        return _MirroredPage(self, index)


class TPCaches:
    """Rank 0's handle on the replica's caches: its own shard (`local`) plus the commands that keep
    the other ranks' shards in step. Page and slot counts are those of every rank; byte sizes are
    per rank. With tp_size > 1 the raw tensors (kv / conv / ssm) are rank 0's shard only, so they are
    not exposed: prefix transfer (workers/transfer.py) between TP replicas is not implemented."""

    def __init__(self, local: ModelCaches, model: TPModel) -> None:
        self.local, self.model = local, model

    kv_block_size = property(lambda self: self.local.kv_block_size)
    num_kv_blocks = property(lambda self: self.local.num_kv_blocks)
    draft_block_size = property(lambda self: self.local.draft_block_size)
    num_draft_blocks = property(lambda self: self.local.num_draft_blocks)
    num_state_slots = property(lambda self: self.local.num_state_slots)

    def _whole(self, name: str):
        if self.model.tp_size > 1:
            raise NotImplementedError(
                f"caches.{name}: with tp_size={self.model.tp_size} each rank holds a shard of the cache "
                "pages; direct page access (prefix transfer between replicas) is not implemented for TP > 1"
            )
        return getattr(self.local, name)

    tp_size = property(lambda self: self.model.tp_size)

    def read_rows(self, kind: str, ids: list[int]) -> list[torch.Tensor]:
        """Pages `ids` of a group kind, every rank's shard (rank-major: `tp_pages.py`; tp_size > 1)."""
        self.model.send(TPCommand.GATHER_ROWS, [KINDS.index(kind), *map(int, ids)])
        return gather_rows(self.local, self.model.group, kind, list(ids))

    def write_rows(self, kind: str, ids: list[int], rows: list[torch.Tensor]) -> None:
        """Write `read_rows`-shaped rows into pages `ids` on every rank."""
        self.model.send(TPCommand.SCATTER_ROWS, [KINDS.index(kind), *map(int, ids)])
        scatter_rows(self.local, self.model.group, kind, list(ids), rows)

    kv = property(lambda self: self._whole("kv"))
    conv = property(lambda self: self._whole("conv"))
    ssm = property(lambda self: self._whole("ssm"))

    @property
    def draft_kv(self) -> dict:
        """Pairs of pools whose `pool[dst].copy_(pool[src])` runs on every rank (cache_manager's use)."""
        if self.model.tp_size == 1:
            return self.local.draft_kv
        return {j: (_MirroredPool(self, j, 0), _MirroredPool(self, j, 1)) for j in self.local.draft_kv}

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        self.model.send(TPCommand.COPY_STATE, [int(src_slot), int(dst_slot)])
        self.local.copy_state(src_slot, dst_slot)

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if not src_slots:
            return
        self.model.send(TPCommand.COPY_STATES, [*map(int, src_slots), *map(int, dst_slots)])
        self.local.copy_states(src_slots, dst_slots)

    def zero_state(self, slot: int) -> None:
        self.model.send(TPCommand.ZERO_STATE, [int(slot)])
        self.local.zero_state(slot)

    def kv_bytes_per_block(self) -> int:
        return self.local.kv_bytes_per_block()

    def draft_kv_bytes_per_block(self) -> int:
        return self.local.draft_kv_bytes_per_block()

    def state_bytes_per_slot(self) -> int:
        return self.local.state_bytes_per_slot()


class _TPMTPHead:
    def __init__(self, model: TPModel) -> None:
        self.model = model

    def forward(self, prev_hidden: torch.Tensor, batch: ForwardBatch, caches: TPCaches) -> torch.Tensor:
        shard = self.model.shard
        batch.validate(caches.draft_block_size, caches.num_draft_blocks, None)
        if prev_hidden.shape[0] != batch.num_tokens:
            raise ValueError(f"prev_hidden has {prev_hidden.shape[0]} rows for {batch.num_tokens} tokens")
        h = prev_hidden.to(shard.device, shard.dtype).contiguous()  # [T, hidden], identical on all ranks
        if self.model.group is not None:
            self.model.send(TPCommand.MTP_FORWARD, encode_batch(batch))
            self.model.group.broadcast(h)
        return shard.mtp.forward(h, batch, caches.local)


class TPModel:
    """Rank 0's model: HybridForCausalLM's interface over tp_size shards.

    config is the full model's; the byte sizes of pages (kv_bytes_per_block, ...) are per rank, so
    EngineConfig.cache_memory_bytes is a per-rank (per-GPU) budget. close() stops the other ranks and
    calls `on_close` (which ends their processes / actors)."""

    def __init__(self, shard: HybridForCausalLM, config: HybridModelConfig, tp_size: int,
                 group: TPGroup | None, on_close=None) -> None:
        if (group is None) != (tp_size == 1):
            raise ValueError("a TPGroup is needed exactly when tp_size > 1")
        self.shard, self.config, self.tp_size, self.group = shard, config, tp_size, group
        self.mtp = _TPMTPHead(self) if shard.mtp is not None else None
        self._on_close = on_close
        self.closed = False

    dtype = property(lambda self: self.shard.dtype)
    device = property(lambda self: self.shard.device)

    def send(self, kind: TPCommand, ints: list[int]) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel model is closed")
        if self.group is not None:
            send_command(self.group, kind, ints)

    def allocate_caches(self, num_kv_blocks: int, kv_block_size: int, num_state_slots: int,
                        num_draft_blocks: int = 0, draft_block_size: int | None = None) -> TPCaches:
        """Every rank allocates its shard; the last allocation is the one the other ranks use."""
        self.send(TPCommand.ALLOCATE, [num_kv_blocks, kv_block_size, num_state_slots, num_draft_blocks,
                                       draft_block_size or 0])
        local = self.shard.allocate_caches(num_kv_blocks, kv_block_size, num_state_slots, num_draft_blocks,
                                           draft_block_size)
        return TPCaches(local, self)

    def forward(self, batch: ForwardBatch, caches: TPCaches) -> torch.Tensor:
        """Full hidden states [T, hidden_size] (every rank computes the same)."""
        batch.validate(caches.kv_block_size, caches.num_kv_blocks,
                       caches.num_state_slots if self.config.mamba_layer_ids else None)
        self.send(TPCommand.FORWARD, encode_batch(batch))
        return self.shard.forward(batch, caches.local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.compute_logits(hidden)

    @property
    def forward_counts(self) -> ForwardCounts:
        """Rank 0's counts (every rank runs the same batches: see forward_counts_by_rank)."""
        return self.shard.forward_counts

    def forward_counts_by_rank(self) -> list[ForwardCounts]:
        """What each rank's shard actually ran (asked over the group, so it is the ranks' own count)."""
        if self.group is None:
            return [self.shard.forward_counts]
        self.send(TPCommand.FORWARD_COUNTS, [])
        return gather_forward_counts(self.shard, self.group)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.shard.kv_bytes_per_block(block_size)

    def draft_kv_bytes_per_block(self, block_size: int) -> int:
        return self.shard.draft_kv_bytes_per_block(block_size)

    def state_bytes_per_slot(self) -> int:
        return self.shard.state_bytes_per_slot()

    def pin_cpus(self, cpus: tuple[int, ...]) -> None:
        """Pin ranks 1..n-1's processes to `cpus` (rank 0 is the caller's to pin)."""
        self.send(TPCommand.PIN_CPUS, [int(c) for c in cpus])

    def close(self) -> None:
        """Stop the other ranks and release the group (idempotent)."""
        if self.closed:
            return
        try:
            self.send(TPCommand.STOP, [])
        finally:
            self.closed = True
            if self.group is not None:
                self.group.close()
            if self._on_close is not None:
                self._on_close()


def serve_tp_commands(shard: HybridForCausalLM, group: TPGroup) -> int:
    """The loop of ranks 1..n-1: run rank 0's commands on this shard until STOP. Returns the number
    of commands served; a failing command is logged and re-raised (the group is then unusable)."""
    caches: ModelCaches | None = None
    num_served = 0
    while True:
        kind, ints = recv_command(group)
        try:
            if kind is TPCommand.STOP:
                return num_served
            if kind is TPCommand.ALLOCATE:
                blocks, block_size, slots, draft_blocks, draft_size = ints
                caches = shard.allocate_caches(blocks, block_size, slots, draft_blocks, draft_size or None)
            elif kind is TPCommand.FORWARD:
                shard.forward(decode_batch(ints), caches)
            elif kind is TPCommand.MTP_FORWARD:
                batch = decode_batch(ints)
                h = torch.empty(batch.num_tokens, shard.config.hidden_size, dtype=shard.dtype,
                                device=group.device)
                shard.mtp.forward(group.broadcast(h), batch, caches)
            elif kind is TPCommand.COPY_STATE:
                caches.copy_state(*ints)
            elif kind is TPCommand.COPY_STATES:
                caches.copy_states(ints[: len(ints) // 2], ints[len(ints) // 2 :])
            elif kind is TPCommand.ZERO_STATE:
                caches.zero_state(*ints)
            elif kind is TPCommand.FORWARD_COUNTS:
                gather_forward_counts(shard, group)
            elif kind is TPCommand.GATHER_ROWS:
                gather_rows(caches, group, KINDS[ints[0]], ints[1:])
            elif kind is TPCommand.SCATTER_ROWS:
                scatter_rows(caches, group, KINDS[ints[0]], ints[1:])
            elif kind is TPCommand.PIN_CPUS:
                from workers.cpu_affinity import pin_this_process

                pin_this_process(tuple(ints))
            elif kind is TPCommand.COPY_DRAFT_PAGE:
                layer, which, src, dst = ints
                pool = caches.draft_kv[layer][which]
                pool[dst].copy_(pool[src])
        except Exception:
            log.exception("TP rank %d: command %s failed", group.rank, kind.name)
            raise
        num_served += 1
