"""A prefill/decode hand-off (`workers/engine/handoff.py`) between processes, over the same
channels as prefix pages (`workers/transfer_channel.py`: gloo on CPU, NCCL on GPU).

    sender (engine A)                                     receiver (engine B)
    int64[2]: header bytes, its xxh3-64; header JSON
      {meta, groups, tensors [dtype, shape]}         ->   bounds, checksum; meta decoded strictly (below);
                                                          B.reserve_import: admitted through B's lookup
                                                     <-   answer: 0 and first_rows per group (the rows
                                                          B's hit already holds) | 1 and why (refused)
    int64[3]: chunk-list bytes, xxh3-64, payload bytes;
      chunk list {chunk_bytes, checksums}            ->   checked against the rows asked for
    chunk 0 | chunk 1 | ... of rows[first_rows:] of
      every page tensor, then the sampler state (<=
      chunk_bytes of one tensor each, all posted)    ->   each lands in place; every chunk is received
                                                          (drained) before any is judged; B.finish_import
                                                          writes them (or cancel_import gives pages back)
                                                     <-   ack: 0 | 1 and why (corrupt, or B refused)

So a decoder that already holds part of the prompt (an earlier turn, a shared system prompt)
receives only the rest: `HandoffSent.first_rows` / `num_skipped_bytes` say what stayed home.

The meta travels as JSON (`workers/handoff_codec.py`: decoded strictly against the dataclasses'
type hints, never an arbitrary object, as `TransferHeader` does for prefix pages). The tensors go
as raw bytes, each chunk with its own xxh3-64 in the header, so a flipped byte is caught before
anything is imported (`HandoffStreamCorrupt`) and a stream that stops (the peer
gone, the channel closed or timed out) raises `HandoffStreamTruncated` on either side.

A failed hand-off loses nothing (`hand_off_or_keep`): the package is plain data and not consumed
by an import, so when the send or B's import fails, A imports it back and decodes the request
itself. A's prompt pages are still in its prefix cache (export finished the request as HANDOFF,
its blocks published), so this re-import writes only what the cache does not hold. We keep the
request on the prefill side instead of retrying another decoder because that needs no new
placement decision and cannot fail for lack of a peer; the router may hand it off again later.
At-least-once, not exactly-once: if B imported but its ack was lost, both engines hold the request
and the caller must drop one stream (B's: the sender's `HandoffDelivery` says it kept it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.errors import HandoffError
from workers.engine.handoff import Handoff, HandoffImport, HandoffMeta
from workers.engine.handoff_import import PageShapes
from workers.handoff_codec import HandoffMetaError, decode_meta, encode_meta
from workers.handoff_frames import (
    HandoffRefused,
    HandoffStreamCorrupt,
    HandoffStreamTruncated,
    HandoffTransferError,
    answer,
    bytes_of,
    post,
    read_answer,
    recv_blob,
    send_blob,
    wait,
)
from workers.transfer import ON_THIS_THREAD, checksum
from workers.transfer_send import DEFAULT_CHUNK_BYTES

DEFAULT_MAX_PAYLOAD_BYTES = 16 * 2**30
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
                               torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)}


@dataclass(frozen=True)
class HandoffSent:
    """A hand-off the receiver acknowledged as imported."""

    request_id: str
    num_payload_bytes: int  # what crossed the channel (the sampler state included)
    num_chunks: int
    first_rows: tuple[int, ...] = ()  # per group: the rows the receiver already held (not sent)
    num_skipped_bytes: int = 0  # the package's bytes in those rows


@dataclass(frozen=True)
class HandoffDelivery:
    """What `hand_off_or_keep` did: delivered, or kept here (`kept`) because of `failure`."""

    request_id: str
    delivered: bool
    kept: HandoffImport | None = None
    failure: str | None = None


def _tensors(handoff: Handoff) -> list[torch.Tensor]:
    state = [] if handoff.sampler_state is None else [handoff.sampler_state]
    return [t for group in handoff.pages for t in group] + state


def _by_group(items, groups: tuple[int, ...]) -> tuple[tuple, ...]:
    """`items` (every page tensor's, in package order) cut into one tuple per group of `groups[g]`."""
    out, start = [], 0
    for n in groups:
        out.append(tuple(items[start : start + n]))
        start += n
    return tuple(out)


def _chunk_bounds(nbytes: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(tensor index, first byte, end byte) per chunk, in stream order."""
    return [(i, a, min(a + chunk_bytes, n)) for i, n in enumerate(nbytes) for a in range(0, n, chunk_bytes)]


def send_handoff(channel, handoff: Handoff, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 corrupt_chunk: int | None = None,
                 before_chunk: Callable[[int], None] | None = None) -> HandoffSent:
    """Stream `handoff` to the channel's peer: the header, then the rows its answer asks for, then
    wait for its ack. Raises `HandoffStreamTruncated` if the channel fails, `HandoffRefused` if the
    peer says no (before or after the rows), `HandoffStreamCorrupt` if its answer makes no sense.

    Fault injection for tests: `corrupt_chunk` flips one byte of that chunk on the wire (after it
    was checksummed; the package itself stays intact); `before_chunk(k)` runs before chunk k is
    posted (a test closes the channel there)."""
    header = json.dumps({
        "meta": encode_meta(handoff.meta),
        "groups": [len(group) for group in handoff.pages],
        "sampler_state": handoff.sampler_state is not None,
        "tensors": [[str(t.dtype), list(t.shape)] for t in _tensors(handoff)],
    }).encode()
    send_blob(channel, header, "the header")
    first_rows = read_answer(channel, len(handoff.pages))
    for group, first in zip(handoff.pages, first_rows):
        if not 0 <= first <= (group[0].shape[0] if group else 0):
            raise HandoffStreamCorrupt(f"the receiver asked for rows from {first_rows}, the package has "
                                       f"{[g[0].shape[0] if g else 0 for g in handoff.pages]}")
    wanted = [t[first:] for group, first in zip(handoff.pages, first_rows) for t in group]
    tensors = [bytes_of(t) for t in wanted + ([] if handoff.sampler_state is None else [handoff.sampler_state])]
    bounds = _chunk_bounds([t.numel() for t in tensors], chunk_bytes)
    chunks = [tensors[i][a:b] for i, a, b in bounds]
    payload = sum(c.numel() for c in chunks)
    send_blob(channel, json.dumps({"chunk_bytes": chunk_bytes, "checksums": [checksum(c) for c in chunks]}).encode(),
               "the chunk list", payload)
    in_flight = []
    for k, chunk in enumerate(chunks):
        if before_chunk is not None:
            before_chunk(k)
        if k == corrupt_chunk:
            chunk = chunk.clone()
            chunk[0] ^= 0xFF
        in_flight.append(post(channel.isend, chunk, f"chunk {k} of {len(chunks)}"))
    for k, work in enumerate(in_flight):
        wait(work, f"chunk {k} of {len(chunks)}")
    read_answer(channel, 0)
    skipped = handoff.nbytes - sum(t.numel() * t.element_size() for t in wanted)
    return HandoffSent(handoff.meta.request_id, payload, len(chunks), tuple(first_rows), skipped)


@dataclass(frozen=True)
class _Header:
    meta: HandoffMeta
    groups: tuple[int, ...]  # page tensors per group
    specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # every page tensor, then the sampler state's
    sampler_state: bool

    @property
    def shapes(self) -> PageShapes:
        return _by_group(self.specs, self.groups)


def _recv_header(channel) -> _Header:
    raw, _ = recv_blob(channel, "header")
    try:
        data = json.loads(raw)
        groups, state = tuple(int(n) for n in data["groups"]), bool(data["sampler_state"])
        specs = tuple((_DTYPES[dtype], tuple(int(d) for d in shape)) for dtype, shape in data["tensors"])
        raw_meta = data["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise HandoffStreamCorrupt(f"hand-off header does not decode: {exc!r}") from exc
    try:
        meta = decode_meta(raw_meta)
    except HandoffMetaError as exc:
        raise HandoffStreamCorrupt(str(exc)) from exc
    if sum(groups) + state != len(specs) or min(groups, default=0) < 0 or any(d < 0 for _, s in specs for d in s):
        raise HandoffStreamCorrupt("hand-off header: the tensor list does not match its groups")
    return _Header(meta, groups, specs, state)


def _recv_rows(channel, header: _Header, first_rows: tuple[int, ...], device,
               max_payload_bytes: int) -> tuple[tuple[tuple[torch.Tensor, ...], ...], torch.Tensor | None]:
    """The rows asked for (per group, from `first_rows` on) and the sampler state, every chunk
    received (drained) before any is judged: a corrupt one raises with the channel still in step."""
    specs = [(dtype, (shape[0] - first, *shape[1:])) for group, first in zip(header.shapes, first_rows)
             for dtype, shape in group] + list(header.specs[sum(header.groups):])
    raw, extra = recv_blob(channel, "chunk list", 1)
    payload_bytes = extra[0]
    try:
        data = json.loads(raw)
        chunk_bytes, checksums = int(data["chunk_bytes"]), [str(c) for c in data["checksums"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise HandoffStreamCorrupt(f"hand-off chunk list does not decode: {exc!r}") from exc
    nbytes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs]
    if sum(nbytes) != payload_bytes or not 0 <= payload_bytes <= max_payload_bytes or chunk_bytes <= 0:
        raise HandoffStreamCorrupt(f"hand-off chunk list: payload {payload_bytes} bytes, chunks of {chunk_bytes}, "
                                   f"the rows asked for are {sum(nbytes)} bytes")
    num_chunks = sum(-(-n // chunk_bytes) for n in nbytes)  # before listing them: chunk_bytes may be tiny
    if num_chunks != len(checksums):
        raise HandoffStreamCorrupt(f"hand-off chunk list: {len(checksums)} checksums for {num_chunks} chunks")
    bounds = _chunk_bounds(nbytes, chunk_bytes)
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    posted = [(k, post(channel.irecv, bytes_of(tensors[i])[a:b], f"chunk {k}")) for k, (i, a, b) in enumerate(bounds)]
    bad = []
    for k, work in posted:
        wait(work, f"chunk {k} of {len(bounds)}")
        i, a, b = bounds[k]
        if checksum(bytes_of(tensors[i])[a:b]) != checksums[k]:
            bad.append(k)
    if bad:
        raise HandoffStreamCorrupt(f"hand-off chunks {bad} of {len(bounds)} failed their checksum")
    state = tensors[-1].cpu() if header.sampler_state else None  # a generator state is a CPU tensor
    return _by_group(tensors, header.groups), state


def recv_handoff(channel, *, device: str | torch.device = "cpu",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Handoff:
    """Receive one whole `send_handoff` package (every row asked for) into tensors on `device`
    and verify it; the final ack is the caller's. Raises `HandoffStreamCorrupt` (told to the
    sender where the stream allows) or `HandoffStreamTruncated`."""
    try:
        header = _recv_header(channel)
    except HandoffStreamCorrupt as exc:
        _say_no(channel, exc)
        raise
    first_rows = tuple(0 for _ in header.groups)
    answer(channel, None, first_rows)
    rows, state = _recv_rows(channel, header, first_rows, device, max_payload_bytes)
    return Handoff(header.meta, rows, state)


def receive_handoff_into(engine, channel, *, on_loop=ON_THIS_THREAD, device: str | torch.device = "cpu",
                         max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> HandoffImport:
    """Receive a hand-off into `engine` (touched only through `on_loop`): reserve it there
    (`reserve_import`: the rows its prefix hit holds are not asked for), receive the rest, write
    them (`finish_import`) and answer the sender. Raises `HandoffStreamCorrupt`,
    `HandoffStreamTruncated` or `HandoffError` (the engine refused it); the reservation is given
    back and the sender told no in each case (unless the channel itself failed)."""
    try:
        header = _recv_header(channel)
    except HandoffStreamCorrupt as exc:
        _say_no(channel, exc)
        raise
    try:
        reservation = on_loop(lambda: engine.reserve_import(header.meta, header.shapes))
    except HandoffError as exc:
        _say_no(channel, exc)
        raise
    try:
        answer(channel, None, reservation.first_rows)
        rows, state = _recv_rows(channel, header, reservation.first_rows, device, max_payload_bytes)
    except HandoffTransferError as exc:
        on_loop(lambda: engine.cancel_import(reservation))
        if isinstance(exc, HandoffStreamCorrupt):
            _say_no(channel, exc)
        raise
    try:
        result = on_loop(lambda: engine.finish_import(reservation, rows, state))
    except HandoffError as exc:
        _say_no(channel, exc)
        raise
    answer(channel, None)
    return result


def _say_no(channel, exc: Exception) -> None:
    """Tell the sender why, best effort: after a corrupt size the stream is out of step and the
    answer may not get through; the sender then times out and keeps the request all the same."""
    try:
        answer(channel, str(exc))
    except HandoffStreamTruncated:
        pass


def hand_off_or_keep(engine, handoff: Handoff, send: Callable[[Handoff], object],
                     on_loop=ON_THIS_THREAD) -> HandoffDelivery:
    """Send `handoff` (exported from `engine`) with `send`, which returns once the receiver has
    imported it and raises otherwise; on any failure import it back into `engine` so the request
    decodes here (module docstring). A `HandoffError` from that re-import (no room here either)
    propagates, and the caller still holds the package to retry."""
    try:
        send(handoff)
        return HandoffDelivery(handoff.meta.request_id, True)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the request must go on somewhere
        failure = f"{type(exc).__name__}: {exc}"
    kept = on_loop(lambda: engine.import_request(handoff))
    return HandoffDelivery(handoff.meta.request_id, False, kept, failure)


__all__ = [
    "HandoffDelivery", "HandoffRefused", "HandoffSent", "HandoffStreamCorrupt", "HandoffStreamTruncated",
    "HandoffTransferError", "hand_off_or_keep", "receive_handoff_into",
    "recv_handoff", "send_handoff",
]
