"""What one engine step feeds the model and reads back: the ForwardBatch built from the scheduled
chunks (with the prompt rows counted: the work a prefix hit must save), and the logits of every row
that samples, in one vocab projection for the whole step."""

from __future__ import annotations

import torch

from workers.engine.cache_manager import EngineCacheManager
from workers.engine.drafter import PendingDrafts
from workers.engine.scheduler import ChunkKind, ScheduledChunk
from workers.engine.step_samples import StepSamples
from workers.model.forward_batch import ForwardBatch, SeqChunk


def build_batch(scheduled: list[ScheduledChunk], cache: EngineCacheManager,
                pending: PendingDrafts | None = None) -> ForwardBatch:
    """One ForwardBatch over every scheduled chunk, in order. Each prefill row is counted on its
    request (`num_computed_prompt_tokens`) and in the batch (`num_prompt_tokens`); a recompute after a
    preemption counts again. Drafts whose values are still on the device (`pending`) are written into
    the input ids there (one gather and one scatter for the step, no read-back)."""
    ids: list[int] = []
    chunks = []
    num_prompt = 0
    fill_rows: list[int] = []  # rows of input_ids taking pending drafts
    fill_from: list[int] = []  # their positions in pending.tokens.flatten()
    for item in scheduled:
        req, n, m = item.req, item.req.num_computed_tokens, item.num_new_tokens
        if item.kind is ChunkKind.PREFILL:  # past the prompt only when resuming after a preemption
            known = req.prompt_token_ids if n + m <= req.num_prompt_tokens else req.all_token_ids
            ids.extend(known[n : n + m])
            req.num_computed_prompt_tokens += m
            num_prompt += m
        elif req.has_pending_drafts:
            ids.append(req.output_token_ids[-1])
            first = pending.flat_index(req)
            fill_rows.extend(range(len(ids), len(ids) + req.num_draft_tokens))
            fill_from.extend(range(first, first + req.num_draft_tokens))
            ids.extend([0] * req.num_draft_tokens)
        else:
            ids.append(req.output_token_ids[-1])
            ids.extend(req.draft_token_ids)
        per_token = cache.verify_pages(req, m) if item.kind is ChunkKind.VERIFY else None
        chunks.append(SeqChunk(n, m, cache.block_table(req), cache.state_page(req), per_token))
    id_range = cache.block_tables.id_range([item.req.request_id for item in scheduled])
    if not fill_rows:
        return ForwardBatch(torch.tensor(ids, dtype=torch.long), tuple(chunks), num_prompt, id_range)
    device = pending.tokens.device
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    drafts = pending.tokens.view(-1).index_select(0, torch.tensor(fill_from, device=device))
    input_ids.index_copy_(0, torch.tensor(fill_rows, device=device), drafts)
    return ForwardBatch(input_ids, tuple(chunks), num_prompt, id_range)


class StepLogits:
    """The logits of every row that samples this step, stacked, with each row's argmax.

    `rows`: [num_rows, vocab] float32 (None when no chunk samples); chunk i's rows are
    `rows[spans[i][0] : spans[i][1]]` (span None: the chunk samples nothing). `argmax`: the index of
    each row's first maximum (torch.argmax's tie rule, as `Sampler.sample` uses). `read_back` copies
    the step's device results to the host at once: every row's argmax and the pending drafts (the
    step's one device -> host copy); greedy requests without logit shaping and verify chunks take
    their tokens from it instead of one argmax and one device read per request."""

    __slots__ = ("rows", "spans", "_argmax", "samples")

    def __init__(self, rows: torch.Tensor | None, spans: list[tuple[int, int] | None]) -> None:
        self.rows, self.spans = rows, spans
        self._argmax: list[int] | None = None
        self.samples: StepSamples | None = None

    def read_back(self, pending: PendingDrafts | None = None, scheduled: list[ScheduledChunk] = ()) -> None:
        """The step's one device -> host copy (a single `.tolist()`): every row's argmax, the pending
        drafts' tokens (delivered to their requests: nothing is pending afterwards) and the `samples`
        of the `scheduled` chunks that need more than the argmax (StepSamples: sampled tokens, logprobs).
        Nothing to read: no copy at all."""
        argmax = None if self.rows is None else torch.argmax(self.rows, dim=-1)  # [num_rows]
        self.samples = StepSamples(scheduled, self.spans, self.rows, argmax)
        parts = ([] if argmax is None else [argmax]) + ([pending.tokens.flatten()] if pending else [])
        num_own = len(parts)
        parts += self.samples.device_parts()
        values = _read_together(parts)
        self._argmax = values[0] if argmax is not None else []
        if pending:
            pending.deliver(values[num_own - 1])
        self.samples.deliver(values[num_own:])

    @property
    def argmax(self) -> list[int]:
        """Every row's argmax (read_back first)."""
        assert self._argmax is not None, "StepLogits.read_back was not called"
        return self._argmax

    def of(self, i: int) -> torch.Tensor:
        """Chunk i's rows, [num_sampling_rows, vocab] (a view)."""
        span = self.spans[i]
        assert self.rows is not None and span is not None, f"chunk {i} samples nothing this step"
        return self.rows[span[0] : span[1]]

    def argmax_of(self, i: int) -> list[int]:
        """The argmax of each of chunk i's rows."""
        span = self.spans[i]
        assert span is not None, f"chunk {i} samples nothing this step"
        return self.argmax[span[0] : span[1]]


def _read_together(parts: list[torch.Tensor]) -> list[list]:
    """Each tensor's values as a list, read with ONE `.tolist()` (float64 when any part is floating:
    int64 token ids below 2**53 and float32 values convert exactly; integer parts come back as ints)."""
    if not parts:
        return []
    floating = any(p.is_floating_point() for p in parts)
    flat = torch.cat([p.flatten().to(torch.float64) for p in parts] if floating else [p.flatten() for p in parts])
    values = flat.tolist()
    out, start = [], 0
    for p in parts:
        chunk = values[start : start + p.numel()]
        out.append([int(v) for v in chunk] if floating and not p.is_floating_point() else chunk)
        start += p.numel()
    return out


def sampling_logits(model, scheduled: list[ScheduledChunk], hidden: torch.Tensor) -> StepLogits:
    """Logits for every row that samples this step, in one `compute_logits` call (one vocab GEMM per
    step instead of one per request): a prefill chunk's last row when it ends the prefill, every row
    of a decode or verify chunk. Call it before the chunks' requests advance (it reads
    `num_computed_tokens`)."""
    picks: list[int] = []
    spans: list[tuple[int, int] | None] = []
    row = 0
    for item in scheduled:
        req, m = item.req, item.num_new_tokens
        if item.kind is not ChunkKind.PREFILL:
            spans.append((len(picks), len(picks) + m))
            picks.extend(range(row, row + m))
        elif req.num_computed_tokens + m == req.num_prefill_tokens:
            spans.append((len(picks), len(picks) + 1))
            picks.append(row + m - 1)
        else:
            spans.append(None)
        row += m
    if not picks:
        return StepLogits(None, spans)
    if len(picks) == row:  # every row samples (a decode-only step): no gather
        chosen = hidden
    else:
        chosen = hidden.index_select(0, torch.tensor(picks, dtype=torch.long, device=hidden.device))
    return StepLogits(model.compute_logits(chosen), spans)  # [len(picks), vocab]
