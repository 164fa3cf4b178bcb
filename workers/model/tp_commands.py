"""The commands rank 0 of a tensor-parallel replica broadcasts to ranks 1..n-1
(`tensor_parallel.py`: `TPModel` sends them, `serve_tp_commands` runs them), and their wire format.

    rank 0 (engine)                         ranks 1..n-1 (serve_tp_commands)
    model.forward(batch, caches)   --->     FORWARD      [batch ints]
    model.mtp.forward(h, batch, c) --->     MTP_FORWARD  [batch ints] + h [T, hidden]
    caches.copy_state(src, dst)    --->     COPY_STATE   [src, dst]
    caches.copy_states(srcs, dsts) --->     COPY_STATES  [srcs..., dsts...]
    caches.zero_state(slot)        --->     ZERO_STATE   [slot]
    draft_kv[j][kv][dst].copy_(..) --->     COPY_DRAFT_PAGE [j, kv, src, dst]
    model.allocate_caches(...)     --->     ALLOCATE     [sizes]
    model.forward_counts_by_rank() --->     FORWARD_COUNTS  (an all-reduce: each rank's ForwardCounts)
    caches.read_rows(kind, ids)    --->     GATHER_ROWS  [kind, ids...]   (tp_pages.py: a hand-off's pages)
    caches.write_rows(kind, ids, r) --->    SCATTER_ROWS [kind, ids...]
    model.pin_cpus(cpus)           --->     PIN_CPUS     [cpus...]   (workers/cpu_affinity.py)
    model.close()                  --->     STOP

A command is two broadcasts: int64 [kind, n] then int64 [n]; a batch travels as its ints
(`encode_batch` / `decode_batch`).
"""

from __future__ import annotations

import enum

import torch

from workers.model.forward_batch import ForwardBatch, ForwardCounts, SeqChunk
from workers.model.hybrid import HybridForCausalLM
from workers.model.tp_group import TPGroup


class TPCommand(enum.IntEnum):
    STOP = 0
    ALLOCATE = 1
    FORWARD = 2
    MTP_FORWARD = 3
    COPY_STATE = 4
    ZERO_STATE = 5
    COPY_DRAFT_PAGE = 6
    FORWARD_COUNTS = 7
    COPY_STATES = 8
    GATHER_ROWS = 9
    SCATTER_ROWS = 10
    PIN_CPUS = 11


def encode_batch(batch: ForwardBatch) -> list[int]:
    """[T, C, ids..., then per chunk: context, new, slot, len(table), has_per_token, table..., per_token...,
    then num_prompt_tokens]"""
    out = [batch.num_tokens, len(batch.chunks), *batch.input_ids.tolist()]
    for c in batch.chunks:
        table = c.block_table.tolist()
        per_token = list(c.per_token_state_slots or ())
        out += [c.num_context_tokens, c.num_new_tokens, c.state_slot, len(table),
                int(c.per_token_state_slots is not None), *table, *per_token]
    return [*out, batch.num_prompt_tokens]


def decode_batch(ints: list[int]) -> ForwardBatch:
    num_tokens, num_chunks = ints[0], ints[1]
    ids, pos, chunks = ints[2 : 2 + num_tokens], 2 + num_tokens, []
    for _ in range(num_chunks):
        context, new, slot, table_len, has_per_token = ints[pos : pos + 5]
        pos += 5
        table = torch.tensor(ints[pos : pos + table_len], dtype=torch.long)
        pos += table_len
        per_token = tuple(ints[pos : pos + new]) if has_per_token else None
        pos += new if has_per_token else 0
        chunks.append(SeqChunk(context, new, table, slot, per_token))
    return ForwardBatch(torch.tensor(ids, dtype=torch.long), tuple(chunks), ints[pos])


def gather_forward_counts(shard: HybridForCausalLM, group: TPGroup) -> list[ForwardCounts]:
    """Every rank's `shard.forward_counts`, by rank (each rank fills its row of a summed table)."""
    table = torch.zeros(group.world_size, 2, dtype=torch.long, device=group.device)
    table[group.rank] = torch.tensor([shard.forward_counts.num_tokens, shard.forward_counts.num_prompt_tokens])
    return [ForwardCounts(*row) for row in group.all_reduce(table).tolist()]


def send_command(group: TPGroup, kind: TPCommand, ints: list[int]) -> None:
    group.broadcast(torch.tensor([int(kind), len(ints)], dtype=torch.long, device=group.device))
    if ints:
        group.broadcast(torch.tensor(ints, dtype=torch.long, device=group.device))


def recv_command(group: TPGroup) -> tuple[TPCommand, list[int]]:
    head = group.broadcast(torch.empty(2, dtype=torch.long, device=group.device)).tolist()
    ints = group.broadcast(torch.empty(head[1], dtype=torch.long, device=group.device)).tolist() if head[1] else []
    return TPCommand(head[0]), ints
