"""The receiving half of a hand-off (`handoff.py`), in two phases so that a transport can send only
the rows the receiver lacks:

    reserve_import(engine, meta, shapes) -> ImportReservation    admit the request through this
                                           engine's lookup: its pages are taken, the hit's blocks
                                           shared; `first_rows[g]`: the rows of group g the hit
                                           already holds here (never sent, never written). The
                                           hit is the KV one (`try_admit(kv_only=True)`): as far
                                           as every attention group serves, Mamba state or not,
                                           since the package brings the working state at its end
    finish_import(engine, reservation, rows, sampler_state)      write the rows from first_rows on,
                                           restore the sampler and counters; decodes next step
    cancel_import(engine, reservation)     the rows never came (corrupt, cut): give the pages back

`import_request(engine, handoff)` does both phases at once with a whole package (in process, or a
prefill engine taking its own package back). Between the phases the reserved request is in no
scheduler queue, so steps in between do not touch its pages; its shared blocks are referenced
and cannot be evicted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cache_service.block_hash import RequestBlockHashes
from workers.engine.errors import HandoffError
from workers.engine.handoff import Handoff, HandoffEngineSpec, HandoffImport, HandoffMeta, LLMEngine, package_specs
from workers.engine.page_tensors import write_rows
from workers.engine.request import Request
from workers.engine.sampling import Sampler

# per group, per page tensor: (dtype, shape [num_rows, *page shape]) of a package's rows
PageShapes = tuple[tuple[tuple[torch.dtype, tuple[int, ...]], ...], ...]


def page_shapes(handoff: Handoff) -> PageShapes:
    return tuple(tuple((t.dtype, tuple(t.shape)) for t in group) for group in handoff.pages)


@dataclass(frozen=True)
class ImportReservation:
    """A hand-off admitted here whose rows are not written yet (module docstring)."""

    meta: HandoffMeta
    request: Request
    hit_tokens: int
    shapes: PageShapes
    first_rows: tuple[int, ...]  # per group: the rows this engine's hit already holds

    def rows_wanted(self, group: int) -> int:
        return self.shapes[group][0][1][0] - self.first_rows[group] if self.shapes[group] else 0


@torch.inference_mode()
def reserve_import(engine: LLMEngine, meta: HandoffMeta, shapes: PageShapes) -> ImportReservation:
    """Admit the handed-off request through this engine's lookup and take its pages. Raises
    `HandoffError` (this engine unchanged) when the engines differ, the id is taken, the page
    shapes are not this engine's or there is no room now."""
    cache = engine.cache
    meta.engine.check_matches(HandoffEngineSpec.of(engine))
    if meta.request_id in engine.requests:
        raise HandoffError(f"request id {meta.request_id!r} is already on this engine")
    _check_page_shapes(cache, shapes)
    req = _rebuild_request(engine, meta)
    if not cache.fits_at_all(req):
        raise HandoffError(f"request {meta.request_id!r} does not fit this engine's KV cache at all")
    n = meta.num_computed_tokens
    # first chunk: the rest of the prefill, so the admission takes pages up to n + k positions
    if not cache.try_admit(req, first_chunk=n, kv_only=True):
        raise HandoffError(f"no room for request {meta.request_id!r} here now; retry later")
    hit = req.num_computed_tokens
    req.num_computed_tokens, req.num_draft_computed_tokens = n, meta.num_draft_computed_tokens
    decoding = bool(meta.boundary_positions)  # boundary states need the decode pages now
    if not cache.can_grow(req, 0, decoding):  # past the prompt (handed off mid-decode): more blocks
        cache.retire(req, keep=False)
        raise HandoffError(f"no room for request {meta.request_id!r} here now; retry later")
    cache.grow(req, 0, decoding)
    first = []
    for group, manager in enumerate(cache.groups.managers):
        rows = shapes[group][0][1][0] if shapes[group] else 0
        # the working Mamba state is always written (B's restored one is at the hit, not at n);
        # lossless draft: the copied block at hit - 1 is rewritten (num_shared_blocks says so)
        first.append(0 if manager.spec.kind == "mamba" else min(manager.num_shared_blocks(hit), rows))
    return ImportReservation(meta, req, hit, shapes, tuple(first))


@torch.inference_mode()
def finish_import(engine: LLMEngine, reservation: ImportReservation,
                  rows: tuple[tuple[torch.Tensor, ...], ...], sampler_state: torch.Tensor | None) -> HandoffImport:
    """Write `rows` (per group, per page tensor: the package's rows from `first_rows` on) into the
    reserved pages and run the request from the next step. Raises `HandoffError` (the reservation
    cancelled) when the rows are not the ones reserved."""
    req, meta = reservation.request, reservation.meta
    for group, tensors in enumerate(rows):
        want = reservation.rows_wanted(group)
        if len(tensors) != len(reservation.shapes[group]) or any(t.shape[0] != want for t in tensors):
            cancel_import(engine, reservation)
            raise HandoffError(f"group {group}: got rows {[t.shape[0] for t in tensors]}, reserved {want} each")
    req.sampler.restore(meta.sampler_seed, sampler_state, engine.config.device)
    written, nbytes = _write_pages(engine.cache, req, meta.boundary_positions, reservation.first_rows, rows)
    _restore_counters(req, meta)
    engine.requests[req.request_id] = req
    engine.scheduler.add_running(req)
    return HandoffImport(req.request_id, reservation.hit_tokens, written, nbytes)


def cancel_import(engine: LLMEngine, reservation: ImportReservation) -> None:
    """Give back a reservation's pages (its rows never came)."""
    engine.cache.retire(reservation.request, keep=False)


def import_request(engine: LLMEngine, handoff: Handoff) -> HandoffImport:
    """Admit the handed-off request through this engine's lookup, write every page its hit does
    not share, and run it from the next step. Raises `HandoffError` (this engine unchanged) when
    the engines differ, the id is taken or there is no room now."""
    reservation = reserve_import(engine, handoff.meta, page_shapes(handoff))
    rows = tuple(tuple(t[first:] for t in group) for group, first in zip(handoff.pages, reservation.first_rows))
    return finish_import(engine, reservation, rows, handoff.sampler_state)


def _check_page_shapes(cache, shapes: PageShapes) -> None:
    if len(shapes) != len(cache.layout.groups):
        raise HandoffError(f"the hand-off has {len(shapes)} cache groups, this engine {len(cache.layout.groups)}")
    for group, specs in enumerate(shapes):
        mine = package_specs(cache, group)
        if (len(specs) != len(mine) or len({shape[0] for _, shape in specs}) > 1
                or any(tuple(shape[1:]) != row_shape or dtype != row_dtype
                       for (dtype, shape), (row_dtype, row_shape) in zip(specs, mine))):
            raise HandoffError(f"group {group}: the hand-off's pages do not have this engine's page shapes")


def _rebuild_request(engine: LLMEngine, meta: HandoffMeta) -> Request:
    """The request as the exporting engine held it, its pages not yet taken (WAITING); its
    sampler's stream is restored by `finish_import`."""
    prompt = list(meta.prompt_token_ids)
    hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                                model_fingerprint=engine.config.model_fingerprint, cache_salt=meta.cache_salt)
    hashes.append(list(meta.output_token_ids))
    eos = () if meta.params.ignore_eos else engine.eos_token_ids
    req = Request(meta.request_id, prompt, meta.params, hashes, meta.cache_salt, sampler=Sampler(meta.params, eos),
                  num_prefill_tokens=meta.num_prefill_tokens)
    req.output_token_ids = list(meta.output_token_ids)
    req.output_logprobs = list(meta.output_logprobs)
    req.num_preemptions = meta.num_preemptions  # before admission: it reads whether this is a first one
    return req


def _write_pages(cache, req: Request, boundary_positions: tuple[int, ...], first_rows: tuple[int, ...],
                 rows: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[tuple[int, ...], int]:
    """Write each group's rows (the package's from `first_rows[g]` on) into the request's pages
    here, the Mamba rows after the working state being the states at `boundary_positions`;
    returns (rows written per group, bytes written)."""
    rid, written, nbytes = req.request_id, [], 0
    for group, manager in enumerate(cache.groups.managers):
        first, tensors = first_rows[group], rows[group]
        count = tensors[0].shape[0] if tensors else 0
        if manager.spec.kind == "mamba":
            slots = manager.slots[rid]
            slots.boundary_positions = list(boundary_positions)
            dst = [slots.working.block_id] + [p.block_id for p in slots.boundary[: len(boundary_positions)]]
        else:
            dst = manager.block_ids(rid)
        written.append(count)
        if count:
            nbytes += write_rows(cache, group, dst[first : first + count], tensors, sidecar=cache.keeps_sidecar)
    return tuple(written), nbytes


def _restore_counters(req: Request, meta: HandoffMeta) -> None:
    req.checkpoints, req.junctions = meta.checkpoints, meta.junctions
    req.periodic_checkpoints = frozenset(meta.periodic_checkpoints)
    req.set_drafts(list(meta.draft_token_ids))
    req.num_cached_tokens, req.num_host_cached_tokens = meta.num_cached_tokens, meta.num_host_cached_tokens
    req.cache_report = meta.cache_report
    req.num_computed_prompt_tokens = meta.num_computed_prompt_tokens
    req.num_draft_proposed, req.num_draft_accepted = meta.num_draft_proposed, meta.num_draft_accepted
    req.first_token_s = time.perf_counter()
    req.arrival_s = req.first_token_s - (meta.ttft_s or 0.0)  # the client's TTFT is the exporter's
