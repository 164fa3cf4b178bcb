"""Draft-token proposers for speculative decoding.

The engine hands a drafter, after every target forward, the rows whose true inputs are now
known: for positions p in [start, start + m) the target hidden state h_p and the next token
t_{p+1}. `MTPDrafter` runs the checkpoint's MTP head over them (writing the draft layer's KV for
those positions: the draft cache group) and, for requests that want drafts, chains k tokens:
d_1 from the last row, then d_j from (MTP hidden of d_{j-1}'s position, d_{j-1}).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.engine.request import Request


@dataclass(frozen=True)
class DeviceDrafts:
    """Drafts left where they were computed: `tokens` int64 [b, k] (row i: request_ids[i]'s chain).
    The engine feeds them to the next step's input ids on the device and reads their values together
    with that step's sampled tokens (one device -> host copy per step, see PendingDrafts)."""

    tokens: torch.Tensor
    request_ids: tuple[str, ...]


@dataclass
class DraftInput:
    req: Request
    start: int  # position of the first row
    hidden: torch.Tensor  # [m, hidden] target hidden states at positions start..start+m-1
    next_token_ids: list[int]  # m tokens: t_{p+1} for each row
    propose: bool  # the request decodes next and wants k drafts


class Drafter(Protocol):
    num_spec_tokens: int

    def run(self, inputs: list[DraftInput]) -> dict[str, list[int]] | DeviceDrafts:
        """Process the rows (updating `req.num_draft_computed_tokens`) and return drafts for the
        inputs with `propose` set: values keyed by request id, or left on the device."""
        ...


class MTPDrafter:
    def __init__(self, model, caches, num_spec_tokens: int, table_of: Callable[[Request], torch.Tensor],
                 id_range_of: Callable[[list[str]], tuple[int, int]] | None = None) -> None:
        """`table_of(req)`: the request's draft-group block table (the engine's draft manager);
        `id_range_of(request_ids)`: the (smallest, largest) id over their tables, when known without
        reading them (`ForwardBatch.block_id_range`)."""
        from workers.model.forward_batch import ForwardBatch, SeqChunk

        self._batch, self._chunk = ForwardBatch, SeqChunk
        self.model = model
        self.caches = caches
        self.num_spec_tokens = num_spec_tokens
        self._table = table_of
        self._id_range = id_range_of
        self.graphs = None  # decode_graphs.DecodeGraphs(draft=True) for the chain's 1-token steps (engine-set)

    @torch.inference_mode()
    def run(self, inputs: list[DraftInput]) -> dict[str, list[int]] | DeviceDrafts:
        if not inputs:
            return {}
        tables = [self._table(i.req) for i in inputs]  # fixed for the whole chain
        chunks = [self._chunk(i.start, len(i.next_token_ids), t, 0) for i, t in zip(inputs, tables)]
        ids = torch.tensor([t for i in inputs for t in i.next_token_ids], dtype=torch.long)
        hidden = torch.cat([i.hidden for i in inputs])
        id_range = self._id_range([i.req.request_id for i in inputs]) if self._id_range else None
        out = self.model.mtp.forward(hidden, self._batch(ids, tuple(chunks), 0, id_range), self.caches)
        drafts: dict[str, list[int]] = {}
        last_rows, row = [], 0
        for i, table in zip(inputs, tables):
            m = len(i.next_token_ids)
            i.req.num_draft_computed_tokens = i.start + m
            row += m
            if i.propose:
                last_rows.append((i, table, row - 1))
        if not last_rows:
            return drafts
        proposing = [i for i, _, _ in last_rows]
        id_range = self._id_range([i.req.request_id for i in proposing]) if self._id_range else None
        tables = [t for _, t, _ in last_rows]
        h = out[[r for _, _, r in last_rows]]  # [b, hidden]
        tokens = torch.argmax(self.model.compute_logits(h), dim=-1)  # [b]
        chain = [tokens]
        for j in range(1, self.num_spec_tokens):
            chunks = [
                self._chunk(i.start + len(i.next_token_ids) - 1 + j, 1, table, 0)
                for i, table in zip(proposing, tables)
            ]
            batch = self._batch(tokens, tuple(chunks), 0, id_range)
            out = self.graphs.run(batch, h) if self.graphs is not None else None  # None: not a graph's
            h = out if out is not None else self.model.mtp.forward(h, batch, self.caches)
            tokens = torch.argmax(self.model.compute_logits(h), dim=-1)
            chain.append(tokens)
        # [b, k] left on the device: read with the next step's sampled tokens
        return DeviceDrafts(torch.stack(chain, dim=1), tuple(i.req.request_id for i in proposing))


class PendingDrafts:
    """The latest DeviceDrafts whose values the host has not read, and which request reads which row.

    A step writes the pending drafts of its verify chunks into its input ids on the device
    (`fill_input_ids`), then `deliver`s the values read back with the step's sampled tokens to every
    request still waiting for them (`Request.has_pending_drafts`; a request preempted meanwhile has
    dropped its drafts and gets nothing). After `deliver` nothing is pending."""

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None  # int64 [b, k]
        self._requests: list[Request] = []
        self._row: dict[int, int] = {}  # id(request) -> its row

    def __bool__(self) -> bool:
        return self.tokens is not None

    def set(self, drafts: DeviceDrafts, requests: list[Request]) -> None:
        """Pending from now: `requests[i]` (its num_draft_tokens set, draft_token_ids empty) reads row i."""
        if len(requests) != drafts.tokens.shape[0]:
            raise ValueError(f"{len(requests)} requests for {drafts.tokens.shape[0]} rows of drafts")
        self.tokens, self._requests = drafts.tokens, requests
        self._row = {id(r): i for i, r in enumerate(requests)}

    def flat_index(self, req: Request) -> int:
        """Where `req`'s first draft sits in tokens.flatten()."""
        return self._row[id(req)] * self.tokens.shape[1]

    def deliver(self, values: list[int]) -> None:
        """`values`: tokens.flatten() read back. Gives each waiting request its first num_draft_tokens."""
        k = self.tokens.shape[1]
        for i, req in enumerate(self._requests):
            if req.has_pending_drafts:
                req.draft_token_ids = values[i * k : i * k + req.num_draft_tokens]
        self.tokens, self._requests, self._row = None, [], {}
