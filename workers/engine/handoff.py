"""Prefill/decode disaggregation, engine level (issue 31): a running request handed from the engine
that prefilled it to another that decodes it, byte-exact, in process.

    engine A   export_request(engine, rid) -> Handoff     after the step that emitted the first token
                                                            (and ran the drafter); A then finishes the
                                                            request as HANDOFF: its blocks stay cached
    engine B   import_request(engine, handoff) -> HandoffImport   admitted through B's own lookup;
                                                            B's next step decodes (or verifies) it
               (`handoff_import.py`; also in two phases, reserve then finish, so that a transport
               sends only the rows B's hit does not hold)

A `Handoff` is plain tensors plus one small frozen `HandoffMeta`, so a later transport can send it
over the page-transfer channel (`workers/transfer.py`). Its pages, per cache group, one tensor per
`package_specs(cache, group)` entry (at TP > 1 every rank's shard: `page_tensors.read_rows`), row j
of each being:

    full    target KV block j of the request, j < ceil(num_computed / block_size) (the partial last
            block included), with its lossless-EAGLE sidecar row when the engine keeps one
    mamba   row 0: the working state (conv + ssm after num_computed tokens); rows 1..: the
            decode-boundary states kept for the next chat turn (`HandoffMeta.boundary_positions`)
    draft   MTP-layer KV block j, j < ceil(num_draft_computed / block_size)

B looks the request up in its own prefix cache and admits it as a hit of L: the blocks the hit
shares are B's cached ones and are not written; every other row is (`HandoffImport.num_bytes_written`).
Draft KV past num_draft_computed (the last chain's speculative positions) is not carried: the next
verify rewrites each such position before anything reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from cache_service.miss_reasons import LookupReport
from workers.engine.cache_manager import EngineCacheManager
from workers.engine.errors import HandoffError
from workers.engine.page_tensors import read_rows, row_specs
from workers.engine.request import FinishReason, Request, RequestStatus
from workers.engine.sampling import TokenLogprobs
from workers.engine.sampling_params import SamplingParams


class LLMEngine(Protocol):
    """What a hand-off reads and changes of `workers.engine.engine.LLMEngine` (a protocol: the
    engine imports this module, not the other way round)."""

    config: object  # EngineConfig
    cache: EngineCacheManager
    scheduler: object  # Scheduler: add_running
    requests: dict[str, Request]
    results: object  # StepResults: finish
    state_copies: object  # PendingStateCopies: flush
    pending_drafts: object  # PendingDrafts: flat_index, tokens
    eos_token_ids: object


@dataclass(frozen=True)
class HandoffEngineSpec:
    """What two engines must agree on for a hand-off's pages and drafts to mean the same thing."""

    model_fingerprint: str
    dtype: str
    kv_block_size: int
    mamba_block_size: int
    num_spec_tokens: int  # 0 without speculation (or without an MTP head)
    eagle_mode: str  # "off" without speculation
    group_kinds: tuple[str, ...]
    tp_size: int = 1  # a TP replica's pages are per-rank shards: only an equal TP size can take them
    checkpoint_grid: str = "mamba"  # where states sit, so where positions (and the boundaries) fall

    @classmethod
    def of(cls, engine: LLMEngine) -> HandoffEngineSpec:
        cache, config = engine.cache, engine.config
        return cls(config.model_fingerprint, config.dtype, config.kv_block_size, config.mamba_block_size,
                   cache.num_spec_tokens, cache.coordinator.eagle.value,
                   tuple(spec.kind for spec in cache.layout.groups), getattr(cache.caches, "tp_size", 1),
                   config.checkpoint_grid)

    def check_matches(self, here: HandoffEngineSpec) -> None:
        """Raise `HandoffError` naming the first field that differs (self: the exporter's)."""
        for f in fields(self):
            theirs, ours = getattr(self, f.name), getattr(here, f.name)
            if theirs != ours:
                raise HandoffError(f"mismatched engines: {f.name} is {theirs!r} on the exporting engine, "
                                   f"{ours!r} here")


@dataclass(frozen=True)
class HandoffMeta:
    """Everything but the pages: the request, its sampler's seed and the engine's counters for it."""

    engine: HandoffEngineSpec
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None
    num_computed_tokens: int  # target KV and Mamba state valid for [0, n)
    num_draft_computed_tokens: int  # draft KV valid for [0, n)
    num_prefill_tokens: int
    draft_token_ids: tuple[int, ...]  # proposed, not verified yet: B verifies them at its next step
    boundary_positions: tuple[int, ...]  # of the Mamba rows 1.., oldest first
    checkpoints: tuple[int, ...]
    periodic_checkpoints: tuple[int, ...]
    junctions: tuple[int, ...]
    sampler_seed: int | None  # the seed the request's generator was made from (None: greedy)
    ttft_s: float | None
    num_cached_tokens: int
    num_host_cached_tokens: int
    num_computed_prompt_tokens: int
    num_draft_proposed: int
    num_draft_accepted: int
    num_preemptions: int
    output_logprobs: tuple[TokenLogprobs, ...] = ()
    cache_report: LookupReport | None = None


@dataclass(frozen=True)
class Handoff:
    """One request's hand-off package (module docstring: the layout of `pages`)."""

    meta: HandoffMeta
    pages: tuple[tuple[torch.Tensor, ...], ...]  # per group, per page tensor: [num_rows, *page shape]
    sampler_state: torch.Tensor | None  # uint8: the seeded generator's state (None: none made yet)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.pages for t in group)


@dataclass(frozen=True)
class HandoffImport:
    """What `import_request` did: B's own hit (its blocks were not written) and what it wrote."""

    request_id: str
    num_hit_tokens: int
    num_pages_written: tuple[int, ...]  # per group
    num_bytes_written: int


def package_specs(cache: EngineCacheManager, group: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, row shape) of each of a group's tensors as a hand-off carries them: every TP rank's
    shard (`page_tensors.row_specs`), the sidecar only where it is kept."""
    return row_specs(cache, group, sidecar=cache.keeps_sidecar)


def _request_pages(cache: EngineCacheManager, req: Request) -> list[list[int]]:
    """Per group, the page ids of the request's rows in a hand-off (module docstring)."""
    out = []
    for manager in cache.groups.managers:
        if manager.spec.kind == "mamba":
            out.append([cache.state_page(req)] + [page for _, page in manager.boundary_states(req.request_id)])
            continue
        valid = req.num_draft_computed_tokens if manager.spec.kind == "draft" else req.num_computed_tokens
        out.append(manager.block_ids(req.request_id)[: -(-valid // manager.block_size)])
    return out


@torch.inference_mode()
def export_request(engine: LLMEngine, request_id: str) -> Handoff:
    """Package `request_id` (running, past its prefill, between steps) and finish it here as
    HANDOFF: its complete blocks are published and stay cached, its pages go back."""
    req = engine.requests.get(request_id)
    if req is None:
        raise HandoffError(f"no unfinished request {request_id!r} on this engine")
    if req.status is not RequestStatus.RUNNING or req.is_prefilling or not req.output_token_ids:
        raise HandoffError(
            f"request {request_id!r} has not finished its prefill ({req.num_computed_tokens} of "
            f"{req.num_prefill_tokens} tokens computed, {len(req.output_token_ids)} emitted): hand it off "
            "after the step that emits its first token")
    engine.state_copies.flush()
    cache = engine.cache
    if req.has_pending_drafts:  # still on the device (drafter.PendingDrafts): read this request's row
        first = engine.pending_drafts.flat_index(req)
        req.set_drafts(engine.pending_drafts.tokens.view(-1)[first : first + req.num_draft_tokens].tolist())
    pages = []
    for group, ids in enumerate(_request_pages(cache, req)):
        pages.append(read_rows(cache, group, ids, sidecar=cache.keeps_sidecar))  # copies: A's pages go back below
    seed, state = req.sampler.state()
    meta = HandoffMeta(
        HandoffEngineSpec.of(engine), request_id, tuple(req.prompt_token_ids), tuple(req.output_token_ids),
        req.params, req.cache_salt, req.num_computed_tokens, req.num_draft_computed_tokens, req.num_prefill_tokens,
        tuple(req.draft_token_ids), tuple(pos for pos, _ in cache.mamba.boundary_states(request_id)),
        tuple(req.checkpoints), tuple(sorted(req.periodic_checkpoints)), tuple(req.junctions),
        seed,
        req.ttft_s, req.num_cached_tokens, req.num_host_cached_tokens, req.num_computed_prompt_tokens,
        req.num_draft_proposed, req.num_draft_accepted, req.num_preemptions, tuple(req.output_logprobs),
        req.cache_report,
    )
    engine.results.finish(req, FinishReason.HANDOFF)  # as a finished request: published, kept, freed
    engine.requests.pop(request_id, None)
    return Handoff(meta, tuple(pages), state)
