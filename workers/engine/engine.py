"""`LLMEngine`: one replica's engine loop over the model, the caches and the scheduler.

    add_request -> Scheduler.waiting -> try_admit (prefix hit restored) -> running
    step(): schedule -> one ForwardBatch (prefill chunks + decodes + verifies) -> target forward
            -> sample / verify + Mamba rollback -> snapshots at checkpoints -> drafter (MTP)
            -> publish completed blocks -> finish (final-boundary snapshots, release)

Speculation: greedy requests only (sampled requests decode one token at a time), verified
greedily, so outputs equal non-speculative greedy decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.coordinator import EagleMode
from cache_service.events import EventSink
from cache_service.ids import new_request_id
from cache_service.messages import HostCopyPrice
from workers.engine.cache_manager import EngineCacheManager
from workers.engine.config import EngineConfig
from workers.engine.drafter import DeviceDrafts, Drafter, DraftInput, MTPDrafter, PendingDrafts
from workers.engine.errors import InvalidRequestError, validate_prompt
from workers.engine.handoff import Handoff, HandoffImport, export_request
from workers.engine.handoff_import import (
    ImportReservation,
    PageShapes,
    cancel_import,
    finish_import,
    import_request,
    reserve_import,
)
from workers.engine.pool_sizing import size_host_pools, size_pools
from workers.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from workers.engine.sampling import Sampler
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ChunkKind, Scheduler
from workers.engine.state_copies import PendingStateCopies
from workers.engine.step_inputs import build_batch, sampling_logits
from workers.engine.step_results import StepResults
from workers.model.decode_graphs import CudaGraphBackend, DecodeGraphs, decode_graphs_for

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model, config: EngineConfig, *, drafter: Drafter | None = None,
                 events: EventSink | None = None, graph_backend=None) -> None:
        """`graph_backend`: replay decode steps through graphs with this backend (decode_graphs.py; tests
        pass EagerReplay on the CPU); None: CudaGraphBackend when `config.cuda_graphs` is on, else eager."""
        self.model = model
        self.config = config
        mconf = model.config
        self.vocab_size = mconf.vocab_size
        self.eos_token_ids = mconf.eos_token_ids  # config.json's eos_token_id: an int or a list
        self.speculative = config.num_spec_tokens > 0 and (model.mtp is not None or drafter is not None)
        if config.num_spec_tokens > 0 and not self.speculative:
            log.info("checkpoint has no MTP head: speculative decoding disabled")
        num_kv_blocks, num_slots = size_pools(model, config, self.speculative)
        graphs = graph_backend is not None or config.cuda_graphs == "on"
        # with graphs, one KV block and one state slot past the pools: the padding rows' scratch pages
        self.caches = model.allocate_caches(
            num_kv_blocks + graphs, config.kv_block_size, num_slots + graphs,
            num_draft_blocks=num_kv_blocks + graphs if self.speculative else 0,
            draft_block_size=config.kv_block_size if self.speculative else None,
        )
        num_host_blocks, num_host_pages = size_host_pools(model, config, self.speculative)
        self.cache = EngineCacheManager(
            config, self.caches, num_kv_blocks, num_slots, mconf.hidden_size, self.speculative, events,
            state_page_bytes=model.state_bytes_per_slot(), num_host_kv_blocks=num_host_blocks,
            num_host_state_pages=num_host_pages,
        )
        self.scheduler = Scheduler(config, self.cache)
        self.decode_graphs = None
        if graphs:
            self.decode_graphs = decode_graphs_for(
                model, self.caches, graph_backend or CudaGraphBackend(), config.max_num_seqs, config.max_model_len,
                scratch_block=num_kv_blocks, scratch_slot=num_slots)
        if self.speculative and drafter is None:
            drafter = MTPDrafter(model, self.caches, config.num_spec_tokens, self.cache.draft_table,
                                 self.cache.draft_tables.id_range)
            if self.decode_graphs is not None:  # the draft chain's 1-token steps too (scratch: the draft pool's last)
                g = self.decode_graphs
                drafter.graphs = DecodeGraphs(model.mtp, self.caches, g.backend, g.batch_buckets, g.key_buckets,
                                              scratch_block=num_kv_blocks, scratch_slot=num_slots, draft=True)
        self.drafter = drafter
        self.requests: dict[str, Request] = {}
        self.state_copies = PendingStateCopies(self.caches)  # a step's rollbacks, copied at once
        self.results = StepResults(self.cache, self.scheduler, self.state_copies, self.speculative)
        self.pending_drafts = PendingDrafts()  # the MTP drafts of the last step, still on the device
        self.num_computed_prompt_tokens = 0  # all requests' prompt tokens sent through the forward
        log.info(
            "engine: %d KV blocks x %d tokens, %d state pages, alignment %d, speculation %s (%s), "
            "host tier %d KV blocks + %d state pages",
            num_kv_blocks, config.kv_block_size, num_slots, self.cache.alignment,
            config.num_spec_tokens if self.speculative else 0, config.eagle_mode.value, num_host_blocks, num_host_pages,
        )

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: EngineConfig | None = None, **kw) -> LLMEngine:
        from workers.model.loader import load_model, model_fingerprint

        config = config or EngineConfig()
        model = load_model(model_dir, dtype=config.torch_dtype, device=config.device, kernels=config.kernels)
        if not config.model_fingerprint:
            config = config.replace(model_fingerprint=model_fingerprint(model_dir))
        return cls(model, config, **kw)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> str:
        params = params or SamplingParams(temperature=0.0)  # an engine-level caller's default: greedy
        prompt = list(prompt_token_ids)
        limit = self.config.max_model_len
        validate_prompt(prompt, self.vocab_size, limit)
        if params.max_tokens is None or params.max_tokens > limit - len(prompt):
            params = params.with_max_tokens(limit - len(prompt))
        request_id = request_id or new_request_id()
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        hashes = RequestBlockHashes(
            self.cache.layout.hash_block_size, prompt, model_fingerprint=self.config.model_fingerprint,
            cache_salt=cache_salt, known=block_hashes,
        )
        eos = () if params.ignore_eos else self.eos_token_ids
        req = Request(request_id, prompt, params, hashes, cache_salt, sampler=Sampler(params, eos))
        if not self.cache.fits_at_all(req):
            raise InvalidRequestError(
                f"prompt + max_tokens ({len(prompt)} + {params.max_tokens}) does not fit the KV cache; "
                "lower max_tokens or raise cache_memory_bytes"
            )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        self.results.finish(req, FinishReason.ABORT)
        self.requests.pop(request_id, None)
        return True

    def export_request(self, request_id: str) -> Handoff:
        """Hand `request_id` off (prefill/decode disaggregation, `handoff.py`): its package for
        another engine's `import_request`; it finishes here as HANDOFF (its blocks stay cached).
        Between steps, after the step that emitted its first token."""
        return export_request(self, request_id)

    def import_request(self, handoff: Handoff) -> HandoffImport:
        """Continue a request another engine exported: admitted through this engine's prefix
        cache (only the pages it lacks are written), decoding from the next step."""
        return import_request(self, handoff)

    def reserve_import(self, meta, shapes: PageShapes) -> ImportReservation:
        """`import_request` in two phases (`handoff_import.py`), for a transport that sends only the
        rows this engine lacks: admit the request and say which rows its hit holds."""
        return reserve_import(self, meta, shapes)

    def finish_import(self, reservation: ImportReservation, rows, sampler_state) -> HandoffImport:
        """Write a reservation's rows (from its `first_rows` on); the request decodes next step."""
        return finish_import(self, reservation, rows, sampler_state)

    def cancel_import(self, reservation: ImportReservation) -> None:
        """Give back a reservation whose rows never came."""
        cancel_import(self, reservation)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> dict[str, int]:
        """Counters and gauges of this engine (replica load reports, /metrics)."""
        sched = self.scheduler
        return {"num_preemptions": sched.num_preemptions, "num_running": len(sched.running),
                "num_waiting": len(sched.waiting), "num_free_kv_blocks": self.cache.num_free_kv_blocks,
                **self.cache.stats()}

    def host_copy_price(self) -> HostCopyPrice | None:
        """A host hit's measured price here (`host_copy_price.py`); None: no host tier, or not
        measured yet."""
        return self.cache.host_pages.meter.price() if self.cache.host_pages is not None else None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        ids = [self.add_request(p, params, cache_salt=cache_salt) for p in prompts]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
            if not self.has_unfinished() and len(done) < len(ids):
                raise RuntimeError("engine stalled with unfinished requests")
        return [done[i] for i in ids]

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()  # cheaper per op than no_grad; nothing made here is mutated outside a step
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        start = time.perf_counter()
        batch = build_batch(scheduled, self.cache, self.pending_drafts)
        self.num_computed_prompt_tokens += batch.num_prompt_tokens
        hidden = self.decode_graphs.run(batch) if self.decode_graphs is not None else None  # None: not a graph's
        if hidden is None:
            hidden = self.model.forward(batch, self.caches)  # [T, hidden]
        logits = sampling_logits(self.model, scheduled, hidden)
        logits.read_back(self.pending_drafts, scheduled)  # the step's device -> host copy
        new_tokens: list[list[int]] = []
        draft_inputs: list[DraftInput] = []
        row = 0
        for i, item in enumerate(scheduled):
            handler = self.results.after_prefill if item.kind is ChunkKind.PREFILL else self.results.after_decode
            tokens, draft_input = handler(item, hidden, row, logits, i)
            row += item.num_new_tokens
            new_tokens.append(tokens)
            if draft_input is not None:
                draft_inputs.append(draft_input)
        self.state_copies.flush()
        if self.cache.host_pages is not None:  # the recompute half of a host hit's price (host_copy_price.py)
            self.cache.host_pages.meter.observe_step(row, batch.num_prompt_tokens, time.perf_counter() - start)
        if self.drafter is not None:
            live = [d for d in draft_inputs if d.req.status is not RequestStatus.FINISHED]
            self._take_drafts(self.drafter.run(live))
        outputs = []
        for item, tokens in zip(scheduled, new_tokens):
            req = item.req
            if req.status is not RequestStatus.FINISHED:
                self.cache.publish(req)
            outputs.append(RequestOutput.of(req, tokens))
            if req.status is RequestStatus.FINISHED:
                self.requests.pop(req.request_id, None)
        return outputs

    def _take_drafts(self, drafts: dict[str, list[int]] | DeviceDrafts) -> None:
        """Each proposing request verifies min(k, room) drafts next step (room: outputs it may still
        emit beyond the one a verify always adds); device drafts stay pending until the next read_back."""
        def room(req: Request) -> int:
            return max(0, req.params.max_tokens - len(req.output_token_ids) - 1)

        if isinstance(drafts, DeviceDrafts):
            reqs = [self.requests[rid] for rid in drafts.request_ids]
            for req in reqs:
                req.draft_token_ids = []
                req.num_draft_tokens = min(drafts.tokens.shape[1], room(req))
                req.num_draft_proposed += req.num_draft_tokens
            self.pending_drafts.set(drafts, reqs)
            return
        for rid, tokens in drafts.items():
            req = self.requests[rid]
            req.set_drafts(tokens[: room(req)])
            req.num_draft_proposed += req.num_draft_tokens


__all__ = ["LLMEngine", "EagleMode"]
