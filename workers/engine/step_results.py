"""`StepResults`: what one engine step's outputs do to each scheduled request. A prefill chunk
records its hidden rows, snapshots its Mamba state at checkpoints and samples the first token; a
decode or verify chunk accepts the longest matching draft run (queuing the Mamba rollback),
tracks the alignment boundaries it passed and appends its tokens; a stop token or the length
limit finishes the request and retires its pages. Each returns the draft input the MTP drafter
takes next, if any."""

from __future__ import annotations

import time

import torch

from workers.engine.cache_manager import EngineCacheManager
from workers.engine.drafter import DraftInput
from workers.engine.request import FinishReason, Request, RequestStatus
from workers.engine.scheduler import ScheduledChunk, Scheduler
from workers.engine.state_copies import PendingStateCopies
from workers.engine.step_inputs import StepLogits


class StepResults:
    """The per-request half of `LLMEngine.step`, after the forward and the logits' read-back."""

    def __init__(self, cache: EngineCacheManager, scheduler: Scheduler, state_copies: PendingStateCopies,
                 speculative: bool) -> None:
        self.cache = cache
        self.scheduler = scheduler
        self.state_copies = state_copies
        self.speculative = speculative

    def wants_drafts(self, req: Request) -> bool:
        """Whether `req` proposes drafts. Every request of a speculative engine still feeds the drafter
        (propose=False), so the draft group's KV covers its tokens and its blocks are published: a
        sampled request's prefix then serves later hits, a greedy resend's included."""
        return self.speculative and req.params.greedy and not req.params.shapes_logits

    def after_prefill(self, item: ScheduledChunk, hidden: torch.Tensor, row: int, logits: StepLogits,
                       index: int) -> tuple[list[int], DraftInput | None]:
        """Chunk `index` of the step, a prefill: its hidden rows are hidden[row : row + m]."""
        req, m = item.req, item.num_new_tokens
        start = req.num_computed_tokens
        rows = hidden[row : row + m]
        self.cache.record_hidden(req, start, rows)
        req.num_computed_tokens = end = start + m
        if end in req.checkpoints:
            self.cache.snapshot(req, self.cache.state_page(req), end)
        tokens: list[int] = []
        if end == req.num_prefill_tokens:  # the prompt, or every known token after a preemption
            # one row: sampling_logits picked this chunk's last row
            token = self._sample(req, logits, index)
            if req.first_token_s is None:
                req.first_token_s = time.perf_counter()
            tokens = self.emit(req, [token], logits, index)
        if not self.speculative or req.status is RequestStatus.FINISHED:
            return tokens, None
        # draft rows: positions [draft_start, end) whose next token is known now
        draft_start = req.num_draft_computed_tokens
        hidden = rows
        if draft_start < start:  # lossless hit: the draft layer's position L-1 from the sidecar
            hidden = torch.cat([self.cache.hit_sidecar(req)[None].to(rows), rows])  # sidecar: CPU fp32
        known = req.all_token_ids
        next_ids = known[draft_start + 1 : end + 1]
        if len(next_ids) < end - draft_start:  # final prompt token's successor not sampled (finished)
            hidden = hidden[: len(next_ids)]
        if not next_ids:
            return tokens, None
        propose = end == req.num_prefill_tokens and self.wants_drafts(req)
        return tokens, DraftInput(req, draft_start, hidden, next_ids, propose)

    def after_decode(self, item: ScheduledChunk, hidden: torch.Tensor, row: int, logits: StepLogits,
                      index: int) -> tuple[list[int], DraftInput | None]:
        """Chunk `index` of the step, a decode or verify (1 + d rows from hidden[row], every one
        sampling)."""
        req, n = item.req, item.req.num_computed_tokens
        drafts = req.draft_token_ids
        if drafts:
            target = logits.argmax_of(index)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            proposal = drafts[:accepted] + [target[accepted]]
            req.num_draft_accepted += accepted
            if accepted < len(drafts):  # else the working page already holds the state after the whole chunk
                # the state after the last accepted token (queued: the step copies all rollbacks at once)
                self.state_copies.add(self.cache.verify_pages(req, accepted + 1)[accepted], self.cache.state_page(req))
        else:
            accepted = 0
            proposal = [self._sample(req, logits, index)]
        req.set_drafts([])
        self.cache.record_hidden(req, n, hidden, row, accepted + 1)
        req.num_computed_tokens = n + accepted + 1
        self._track_boundaries(req, n, accepted + 1, bool(drafts))
        tokens = self.emit(req, proposal, logits, index)
        if not self.speculative or req.status is RequestStatus.FINISHED:
            return tokens, None
        next_ids = req.all_token_ids[n + 1 : n + accepted + 2]
        return tokens, DraftInput(req, n, hidden[row : row + len(next_ids)], next_ids, self.wants_drafts(req))

    @staticmethod
    def _sample(req: Request, logits: StepLogits, index: int) -> int:
        """The token chunk `index` samples from its first sampling row."""
        if req.sampler.is_argmax:  # the step's batched argmax: no per-request tensor op
            return logits.argmax_of(index)[0]
        return logits.samples.tokens_of[index]  # sampled on the device before the step's read-back

    def _track_boundaries(self, req: Request, start: int, count: int, verified: bool) -> None:
        """Keep the Mamba states at the last two alignment boundaries passed while decoding
        (the final boundary F and F - A), for the next chat turn."""
        step = self.cache.alignment
        if (start + count) // step == start // step:  # no boundary in (start, start + count]
            return
        for pos in range(start + 1, start + count + 1):
            if pos % step:
                continue
            verify = self.cache.verify_pages(req, count)
            src = verify[pos - start - 1] if verified else self.cache.state_page(req)
            self.cache.mamba.track_boundary(req.request_id, pos, src)

    def emit(self, req: Request, tokens: list[int], logits: StepLogits, index: int) -> list[int]:
        """Append sampled tokens, stopping at a stop token or the length limit; row i of chunk
        `index`'s logits is the row `tokens[i]` was chosen from (its logprobs: logits.samples)."""
        out = []
        stops = req.sampler.stop_token_ids  # the request's stop ids and, unless ignore_eos, the model's EOS
        num_logprobs = req.params.logprobs
        logprobs = logits.samples.logprobs_of[index] if num_logprobs is not None else None
        reason = None
        for i, t in enumerate(tokens):
            out.append(t)
            req.output_token_ids.append(t)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])  # row i's emitted token's, computed before the read-back
            if t in stops:
                reason = FinishReason.STOP
                break
            if len(req.output_token_ids) >= req.params.max_tokens:
                reason = FinishReason.LENGTH
                break
        req.hashes.append(out)
        if reason is not None:
            self.finish(req, reason)
        return out

    def finish(self, req: Request, reason: FinishReason) -> None:
        self.state_copies.flush()  # its working page is snapshotted and given back below
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        self.scheduler.remove(req)
        if self.cache.holds(req):
            self.cache.retire(req, keep=reason is not FinishReason.ABORT)
