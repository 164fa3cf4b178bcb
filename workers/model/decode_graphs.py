"""CUDA graphs for decode and verify steps, one per (chunk length, batch-size bucket, key-length bucket), as
vLLM captures them.

A decode step's host cost on a GPU is hundreds of kernel launches (every layer's ops); a graph replays
them as one launch. A graph replays fixed shapes and addresses, so a step is padded to its buckets:

    length   every chunk L new tokens: decodes (L = 1) or MTP verifies (L = 1 + k, per-token state slots)
    batch    n real chunks -> B = the smallest batch bucket >= n; chunks n..B-1 are padding (context 1,
             block table [scratch block], every state slot the scratch slot): they read and write only a
             KV block and a Mamba state slot no request owns, and their outputs are dropped
    keys     every chunk's positions -> S = the smallest key bucket >= the longest; one SDPA group
             [B, L, S] with masked padding keys (PagedPlan.build_padded_decode)

Each (L, B, S) graph owns static copies of the step inputs (input ids, the attention plan's slots / mask,
the Mamba slots); a step builds its plan on the host as usual, copies it into the static buffers and
replays. Capture happens at a bucket's first use, with every row pointing at the scratch pages (the
warm-up run writes only there). Steps that do not qualify run eagerly: prefill chunks, chunks of
different lengths (decodes next to verifies, a verify cut short near max_tokens), a fresh (context 0)
chunk, more chunks or positions than the largest bucket. The MTP head's draft forwards run eagerly.

Backends: `CudaGraphBackend` (torch.cuda.CUDAGraph, one memory pool) and, for CPU tests, `EagerReplay`,
which "replays" by calling the captured function again on the static buffers: the same padding, buckets
and buffer copies run without a GPU, so the logic is tested on every machine. The CUDA backend has not
run here (no GPU was available when this was written); it is off unless `cuda_graphs: on`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from workers.model.forward_batch import ForwardBatch, SeqChunk, VerifyGroup
from workers.model.mamba_plan import DecodePlan, MambaPlan
from workers.model.paged_plan import PagedPlan

log = logging.getLogger(__name__)


def default_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's capture sizes), and max_num_seqs."""
    sizes = {1, 2, 4, max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


def default_key_buckets(block_size: int, max_model_len: int) -> tuple[int, ...]:
    """Powers of two times the block size, the last one covering max_model_len (each bucket at most
    doubles a step's attention work)."""
    out, size = [], block_size
    while size < max_model_len:
        out.append(size)
        size *= 2
    return (*out, -(-max_model_len // block_size) * block_size)


def bucket_for(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value (buckets sorted), or None when value exceeds them all."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


class EagerReplay:
    """A graph backend without graphs: `capture(fn)` runs fn once (the warm-up) and returns fn as the
    replay. CPU tests drive the graph runner's padding, buckets and static buffers through it."""

    name = "eager-replay"

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        holder = [out]

        def replay() -> None:
            holder[0].copy_(fn())  # a graph writes its static output in place
        return replay, holder[0]


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture after a warm-up on a side stream; all graphs share one memory pool."""

    name = "cuda-graph"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("cuda_graphs: on needs a CUDA device")
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy inits (cuBLAS handles, workspaces) must not happen during capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


@dataclass
class _Graph:
    """One captured bucket: static inputs, the static output, and the replay."""

    input_ids: torch.Tensor  # int64 [B * L]
    prev_hidden: torch.Tensor | None  # [B * L, hidden]: the MTP head's second input (draft graphs)
    plan: PagedPlan | None
    mamba_slots: tuple[torch.Tensor, ...]  # decode: (slots [B],); verify: (state slots [B], token slots [B * L])
    replay: Callable[[], None]
    output: torch.Tensor  # [B * L, hidden]

    def load(self, input_ids: torch.Tensor, plan: PagedPlan | None, mamba_slots: tuple[torch.Tensor, ...],
             prev_hidden: torch.Tensor | None = None) -> None:
        """Copy one step's inputs into the static buffers (same shapes: the same buckets; prev_hidden: the
        real rows only, padding rows keep what they hold)."""
        self.input_ids.copy_(input_ids)
        if prev_hidden is not None:
            self.prev_hidden[: prev_hidden.shape[0]].copy_(prev_hidden)
        if plan is not None:
            g, src = self.plan.sdpa_groups[0], plan.sdpa_groups[0]
            for dst_t, src_t in ((self.plan.write_slots, plan.write_slots), (self.plan.positions, plan.positions),
                                 (g.key_slots, src.key_slots), (g.mask, src.mask)):
                dst_t.copy_(src_t)
        for dst_t, src_t in zip(self.mamba_slots, mamba_slots):
            dst_t.copy_(src_t)


class DecodeGraphs:
    """Decode and verify steps of `model` over `caches` through graphs (see the module docstring)."""

    def __init__(self, model, caches, backend, batch_buckets: tuple[int, ...], key_buckets: tuple[int, ...],
                 scratch_block: int, scratch_slot: int, draft: bool = False) -> None:
        """`model`: the target (HybridForCausalLM) or, with `draft`, its MTP head (1-token draft steps over
        the draft KV pool, with the previous hidden states as a second input). `scratch_block` /
        `scratch_slot`: a KV block (of the draft pool with `draft`) and a state slot no request uses."""
        self.model, self.caches, self.backend, self.draft = model, caches, backend, draft
        self.batch_buckets, self.key_buckets = tuple(sorted(batch_buckets)), tuple(sorted(key_buckets))
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.block_size = caches.draft_block_size if draft else caches.kv_block_size
        self.has_attention = bool(caches.draft_kv if draft else caches.kv)
        self.has_mamba = bool(caches.conv) and not draft
        self.device = next(model.parameters()).device
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.num_replays = 0
        log.info("decode graphs (%s): batch buckets %s, key buckets %s", backend.name, self.batch_buckets,
                 self.key_buckets)

    def buckets(self, batch: ForwardBatch) -> tuple[int, int, int] | None:
        """(L, B, S) for a batch a graph can run, else None (it runs eagerly): every chunk L new tokens
        on context > 0, decodes (L = 1, no per-token slots) or verifies (L > 1, per-token slots)."""
        chunks = batch.chunks
        length = chunks[0].num_new_tokens
        if self.draft and length != 1:
            return None
        for c in chunks:
            if c.num_new_tokens != length or c.num_context_tokens == 0 or \
                    (not self.draft and (c.per_token_state_slots is None) != (length == 1)):
                return None
        b = bucket_for(len(chunks), self.batch_buckets)
        s = bucket_for(max(c.num_total_tokens for c in chunks), self.key_buckets)
        return None if b is None or s is None else (length, b, s)

    def pad(self, batch: ForwardBatch, length: int, num_chunks: int) -> ForwardBatch:
        """The batch with num_chunks - n padding chunks of `length` tokens on the scratch pages appended
        (not validated: they share the scratch slot)."""
        extra = num_chunks - len(batch.chunks)
        table = torch.tensor([self.scratch_block] * -(-(1 + length) // self.block_size))
        per_token = None if length == 1 else (self.scratch_slot,) * length
        padding = tuple(SeqChunk(1, length, table, self.scratch_slot, per_token) for _ in range(extra))
        pad_ids = torch.zeros(extra * length, dtype=torch.long, device=batch.input_ids.device)
        ids = torch.cat([batch.input_ids, pad_ids]) if extra else batch.input_ids
        return replace(batch, input_ids=ids, chunks=batch.chunks + padding, block_id_range=None)

    def inputs(self, batch: ForwardBatch, length: int, num_chunks: int, num_keys: int):
        """The static-shaped inputs of a padded step: (input_ids [B * L], plan, Mamba slot tensors)."""
        padded = self.pad(batch, length, num_chunks)
        device = self.device
        plan = PagedPlan.build_padded_decode(padded, self.block_size, device, num_keys) if self.has_attention else None
        slots: tuple[torch.Tensor, ...] = ()
        if self.has_mamba:
            slots = (torch.tensor([c.state_slot for c in padded.chunks], device=device),)
            if length > 1:
                slots += (torch.tensor([s for c in padded.chunks for s in c.per_token_state_slots], device=device),)
        return padded.input_ids.to(device), plan, slots

    def run(self, batch: ForwardBatch, prev_hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states [T, hidden] of a qualifying batch through its bucket's graph (captured at first
        use), or None: the caller runs the model eagerly. `prev_hidden` [T, hidden]: draft graphs only."""
        key = self.buckets(batch)
        if key is None:
            return None
        if self.draft and (prev_hidden is None or prev_hidden.shape[0] != batch.num_tokens):
            raise ValueError("a draft step needs prev_hidden with one row per token")
        self.model.admit_batch(batch, self.caches)  # the real batch is validated (and counted)
        graph = self.graphs.get(key) or self._capture(*key)
        graph.load(*self.inputs(batch, *key), prev_hidden)
        graph.replay()
        self.num_replays += 1
        return graph.output[: batch.num_tokens]

    def _capture(self, length: int, num_chunks: int, num_keys: int) -> _Graph:
        scratch = ForwardBatch(torch.zeros(0, dtype=torch.long), ())
        ids, plan, slots = self.inputs(scratch, length, num_chunks, num_keys)  # every row on the scratch pages
        mamba_plan = None
        if length == 1 and slots:
            mamba_plan = MambaPlan(DecodePlan(slice(0, num_chunks), slots[0], None), (), None)
        elif slots:
            group = VerifyGroup(num_chunks, length, slice(0, num_chunks * length), slots[0], slots[1], ())
            mamba_plan = MambaPlan(None, (group,), None)

        hidden = None
        if self.draft:
            weight = self.model.layers[0].eh_proj.weight  # [hidden, 2 * hidden]
            hidden = torch.zeros(num_chunks * length, weight.shape[0], dtype=weight.dtype, device=self.device)

        def forward() -> torch.Tensor:
            if self.draft:
                return self.model.forward_planned(ids, hidden, plan, mamba_plan, self.caches)
            return self.model.forward_planned(ids, plan, mamba_plan, self.caches)

        replay, output = self.backend.capture(forward)
        graph = _Graph(ids, hidden, plan, slots, replay, output)
        self.graphs[(length, num_chunks, num_keys)] = graph
        log.info("captured a graph for %d chunks x %d tokens x %d keys", num_chunks, length, num_keys)
        return graph


def decode_graphs_for(model, caches, backend, max_num_seqs: int, max_model_len: int, scratch_block: int,
                      scratch_slot: int) -> DecodeGraphs | None:
    """A DecodeGraphs for `model`, or None (logged) when its forward cannot be captured: another kernel
    set than torch (flash-attn varlen takes host ints), MoE layers (tokens grouped per expert: data-
    dependent shapes), a tensor-parallel proxy, or no attention pool."""
    from workers.model.config import LayerKind
    from workers.model.hybrid import HybridForCausalLM

    why = None
    if not isinstance(model, HybridForCausalLM):
        why = f"{type(model).__name__} (tensor parallel) is not captured"
    elif model.kernels.name != "torch":
        why = f"kernel set {model.kernels.name!r}: only the torch kernels are captured"
    elif LayerKind.MOE in model.config.layer_kinds:
        why = "MoE layers have data-dependent shapes"
    elif not caches.kv:
        why = "no attention layers"
    if why is not None:
        log.info("decode graphs off: %s", why)
        return None
    return DecodeGraphs(model, caches, backend, default_batch_buckets(max_num_seqs),
                        default_key_buckets(caches.kv_block_size, max_model_len), scratch_block, scratch_slot)
