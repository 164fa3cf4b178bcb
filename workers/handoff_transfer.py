"""A prefill/decode hand-off (`workers/engine/handoff.py`) between processes, over the same
channels as prefix pages (`workers/transfer_channel.py`: gloo on CPU, NCCL on GPU).

    sender (engine A)                                     receiver (engine B)
    sizes int64[3]: header bytes, payload bytes,
                    xxh3-64 of the header            ->   bounds checked; header received, checksummed
    header: JSON {meta, tensors [dtype, shape],
                  chunk_bytes, checksums}            ->   meta decoded strictly (below); tensors allocated
    chunk 0 | chunk 1 | ...  (<= chunk_bytes of one
                  tensor each, all posted at once)   ->   each lands in place in its tensor; every chunk
                                                          is received (drained) before any is judged
                                                     <-   ack int64[2]: 0 | 1, reason length; reason
                                                          (1: corrupt or refused by B's import)

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
import xxhash

from workers.engine.errors import HandoffError
from workers.engine.handoff import Handoff, HandoffImport
from workers.handoff_codec import HandoffMetaError, decode_meta, encode_meta
from workers.transfer import DEFAULT_CHUNK_BYTES, ON_THIS_THREAD, TransferError, checksum

MAX_HEADER_BYTES = 64 * 2**20
MAX_REASON_BYTES = 2**16
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 2**30
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
                               torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)}


class HandoffTransferError(TransferError):
    """A hand-off did not arrive; the sender keeps the request (`hand_off_or_keep`)."""


class HandoffStreamCorrupt(HandoffTransferError):
    """A chunk or the header failed its checksum, or the header does not decode: nothing imported."""


class HandoffStreamTruncated(HandoffTransferError):
    """The channel failed mid-stream (the peer died, closed it, or timed out)."""


class HandoffRefused(HandoffTransferError):
    """The receiver answered no: the package arrived corrupt or its engine refused the import."""


@dataclass(frozen=True)
class HandoffSent:
    """A hand-off the receiver acknowledged as imported."""

    request_id: str
    num_payload_bytes: int
    num_chunks: int


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


def _chunk_bounds(nbytes: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(tensor index, first byte, end byte) per chunk, in stream order."""
    return [(i, a, min(a + chunk_bytes, n)) for i, n in enumerate(nbytes) for a in range(0, n, chunk_bytes)]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _wait(work, what: str):
    try:
        return work.wait()
    except RuntimeError as exc:  # gloo / NCCL: connection closed by peer, timed out, aborted
        raise HandoffStreamTruncated(f"the hand-off channel failed at {what}: {exc}") from exc


def _post(op, tensor: torch.Tensor, what: str):
    try:
        return op(tensor)
    except RuntimeError as exc:
        raise HandoffStreamTruncated(f"the hand-off channel failed at {what}: {exc}") from exc


def send_handoff(channel, handoff: Handoff, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, await_ack: bool = True,
                 corrupt_chunk: int | None = None,
                 before_chunk: Callable[[int], None] | None = None) -> HandoffSent:
    """Stream `handoff` to the channel's peer and, with `await_ack`, wait for its answer. Raises
    `HandoffStreamTruncated` if the channel fails, `HandoffRefused` if the peer says no.

    Fault injection for tests: `corrupt_chunk` flips one byte of that chunk on the wire (after it
    was checksummed; the package itself stays intact); `before_chunk(k)` runs before chunk k is
    posted (a test closes the channel there)."""
    tensors = [_bytes_of(t) for t in _tensors(handoff)]
    bounds = _chunk_bounds([t.numel() for t in tensors], chunk_bytes)
    chunks = [tensors[i][a:b] for i, a, b in bounds]
    header = json.dumps({
        "meta": encode_meta(handoff.meta),
        "groups": [len(group) for group in handoff.pages],
        "sampler_state": handoff.sampler_state is not None,
        "tensors": [[str(t.dtype), list(t.shape)] for t in _tensors(handoff)],
        "chunk_bytes": chunk_bytes,
        "checksums": [checksum(c) for c in chunks],
    }).encode()
    payload = sum(c.numel() for c in chunks)
    sizes = torch.tensor([len(header), payload, xxhash.xxh3_64_intdigest(header) - 2**63], dtype=torch.int64)
    _wait(_post(channel.isend, sizes, "the sizes"), "the sizes")
    _wait(_post(channel.isend, torch.frombuffer(bytearray(header), dtype=torch.uint8), "the header"), "the header")
    in_flight = []
    for k, chunk in enumerate(chunks):
        if before_chunk is not None:
            before_chunk(k)
        if k == corrupt_chunk:
            chunk = chunk.clone()
            chunk[0] ^= 0xFF
        in_flight.append(_post(channel.isend, chunk, f"chunk {k} of {len(chunks)}"))
    for k, work in enumerate(in_flight):
        _wait(work, f"chunk {k} of {len(chunks)}")
    if await_ack:
        status = torch.zeros(2, dtype=torch.int64)
        _wait(_post(channel.irecv, status, "the ack"), "the ack")
        if int(status[0]) != 0:
            if not 0 <= int(status[1]) <= MAX_REASON_BYTES:
                raise HandoffStreamCorrupt(f"the receiver's answer is malformed: {status.tolist()}")
            reason = torch.empty(int(status[1]), dtype=torch.uint8)
            _wait(_post(channel.irecv, reason, "the ack"), "the ack")
            why = reason.numpy().tobytes().decode(errors="replace")
            raise HandoffRefused(f"the receiver refused the hand-off: {why}")
    return HandoffSent(handoff.meta.request_id, payload, len(chunks))


def recv_handoff(channel, *, device: str | torch.device = "cpu",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Handoff:
    """Receive one `send_handoff` stream into tensors on `device` and verify it (no ack sent).
    Raises `HandoffStreamCorrupt` (every chunk drained first: the channel stays usable, but for a
    corrupt header) or `HandoffStreamTruncated`."""
    sizes = torch.empty(3, dtype=torch.int64)
    _wait(_post(channel.irecv, sizes, "the sizes"), "the sizes")
    header_bytes, payload_bytes, header_sum = (int(v) for v in sizes)
    if not 0 < header_bytes <= MAX_HEADER_BYTES or not 0 <= payload_bytes <= max_payload_bytes:
        raise HandoffStreamCorrupt(f"hand-off sizes out of bounds: header {header_bytes}, payload {payload_bytes}")
    raw = torch.empty(header_bytes, dtype=torch.uint8)
    _wait(_post(channel.irecv, raw, "the header"), "the header")
    header = raw.numpy().tobytes()
    if xxhash.xxh3_64_intdigest(header) - 2**63 != header_sum:
        raise HandoffStreamCorrupt("the hand-off header failed its checksum")
    meta, groups, tensors, bounds, checksums = _parse_header(header, payload_bytes, device)
    posted = [(k, _post(channel.irecv, _bytes_of(tensors[i])[a:b], f"chunk {k}"))
              for k, (i, a, b) in enumerate(bounds)]
    bad = []
    for k, work in posted:
        _wait(work, f"chunk {k} of {len(bounds)}")
        i, a, b = bounds[k]
        if checksum(_bytes_of(tensors[i])[a:b]) != checksums[k]:
            bad.append(k)
    if bad:
        raise HandoffStreamCorrupt(f"hand-off chunks {bad} of {len(bounds)} failed their checksum")
    pages, start = [], 0
    for n in groups:
        pages.append(tuple(tensors[start : start + n]))
        start += n
    state = tensors[start].cpu() if start < len(tensors) else None  # a generator state is a CPU tensor
    return Handoff(meta, tuple(pages), state)


def _parse_header(header: bytes, payload_bytes: int, device):
    """(meta, tensors per group, the allocated tensors, chunk bounds, checksums) of a checked header."""
    try:
        data = json.loads(header)
        groups, state = [int(n) for n in data["groups"]], bool(data["sampler_state"])
        specs = [(_DTYPES[dtype], [int(d) for d in shape]) for dtype, shape in data["tensors"]]
        chunk_bytes, checksums = int(data["chunk_bytes"]), [str(c) for c in data["checksums"]]
        raw_meta = data["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise HandoffStreamCorrupt(f"hand-off header does not decode: {exc!r}") from exc
    try:
        meta = decode_meta(raw_meta)
    except HandoffMetaError as exc:
        raise HandoffStreamCorrupt(str(exc)) from exc
    nbytes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs]
    if (sum(groups) + state != len(specs) or min(groups, default=0) < 0 or chunk_bytes <= 0
            or any(d < 0 for _, shape in specs for d in shape) or sum(nbytes) != payload_bytes):
        raise HandoffStreamCorrupt("hand-off header: tensor list does not match its groups or payload size")
    num_chunks = sum(-(-n // chunk_bytes) for n in nbytes)  # before listing them: chunk_bytes may be tiny
    if num_chunks != len(checksums):
        raise HandoffStreamCorrupt(f"hand-off header: {len(checksums)} checksums for {num_chunks} chunks")
    bounds = _chunk_bounds(nbytes, chunk_bytes)
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    return meta, groups, tensors, bounds, checksums


def _reply(channel, reason: str | None) -> None:
    body = (reason or "").encode()[:MAX_REASON_BYTES]
    _wait(_post(channel.isend, torch.tensor([int(reason is not None), len(body)], dtype=torch.int64), "the ack"),
          "the ack")
    if reason is not None:
        _wait(_post(channel.isend, torch.frombuffer(bytearray(body), dtype=torch.uint8), "the ack"), "the ack")


def receive_handoff_into(engine, channel, *, on_loop=ON_THIS_THREAD, device: str | torch.device = "cpu",
                         max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> HandoffImport:
    """Receive a hand-off, import it into `engine` (through `on_loop`, where the engine may be
    touched) and answer the sender. Raises as `recv_handoff` does, or `HandoffError` when the
    engine refuses it; the sender is told no in both cases (unless the channel itself failed)."""
    try:
        handoff = recv_handoff(channel, device=device, max_payload_bytes=max_payload_bytes)
    except HandoffStreamCorrupt as exc:
        _say_no(channel, exc)
        raise
    try:
        result = on_loop(lambda: engine.import_request(handoff))
    except HandoffError as exc:
        _say_no(channel, exc)
        raise
    _reply(channel, None)
    return result


def _say_no(channel, exc: Exception) -> None:
    """Tell the sender why, best effort: after a corrupt header the stream is out of step and the
    answer may not get through; the sender then times out and keeps the request all the same."""
    try:
        _reply(channel, str(exc))
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
