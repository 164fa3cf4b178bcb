"""Framing of the hand-off stream (`handoff_transfer.py`): its typed errors, checksummed blobs
(sizes, then bytes) and the receiver's answers, over a pair channel's `isend` / `irecv`. A channel
error becomes `HandoffStreamTruncated`, a blob that fails its checksum `HandoffStreamCorrupt`."""

from __future__ import annotations

import torch
import xxhash

from workers.transfer import TransferError

MAX_HEADER_BYTES = 64 * 2**20
MAX_REASON_BYTES = 2**16


class HandoffTransferError(TransferError):
    """A hand-off did not arrive; the sender keeps the request (`hand_off_or_keep`)."""


class HandoffStreamCorrupt(HandoffTransferError):
    """A chunk or the header failed its checksum, or the header does not decode: nothing imported."""


class HandoffStreamTruncated(HandoffTransferError):
    """The channel failed mid-stream (the peer died, closed it, or timed out)."""


class HandoffRefused(HandoffTransferError):
    """The receiver answered no: the package arrived corrupt or its engine refused the import."""


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def wait(work, what: str):
    try:
        return work.wait()
    except RuntimeError as exc:  # gloo / NCCL: connection closed by peer, timed out, aborted
        raise HandoffStreamTruncated(f"the hand-off channel failed at {what}: {exc}") from exc


def post(op, tensor: torch.Tensor, what: str):
    try:
        return op(tensor)
    except RuntimeError as exc:
        raise HandoffStreamTruncated(f"the hand-off channel failed at {what}: {exc}") from exc


def _send(channel, tensor: torch.Tensor, what: str) -> None:
    wait(post(channel.isend, tensor, what), what)


def _recv(channel, tensor: torch.Tensor, what: str) -> torch.Tensor:
    wait(post(channel.irecv, tensor, what), what)
    return tensor


def send_blob(channel, blob: bytes, what: str, *extra: int) -> None:
    """sizes int64[2 + len(extra)]: blob bytes, its xxh3-64, *extra; then the blob."""
    sizes = [len(blob), xxhash.xxh3_64_intdigest(blob) - 2**63, *extra]
    _send(channel, torch.tensor(sizes, dtype=torch.int64), what)
    _send(channel, torch.frombuffer(bytearray(blob), dtype=torch.uint8), what)


def recv_blob(channel, what: str, num_extra: int = 0, max_bytes: int = MAX_HEADER_BYTES) -> tuple[bytes, list[int]]:
    sizes = _recv(channel, torch.empty(2 + num_extra, dtype=torch.int64), what).tolist()
    if not 0 < sizes[0] <= max_bytes:
        raise HandoffStreamCorrupt(f"hand-off {what} size out of bounds: {sizes[0]}")
    blob = _recv(channel, torch.empty(sizes[0], dtype=torch.uint8), what).numpy().tobytes()
    if xxhash.xxh3_64_intdigest(blob) - 2**63 != sizes[1]:
        raise HandoffStreamCorrupt(f"the hand-off {what} failed its checksum")
    return blob, sizes[2:]


def answer(channel, reason: str | None, values: tuple[int, ...] = ()) -> None:
    """int64[2]: 0, len(values) | 1, reason bytes; then the values (if any) or the reason."""
    body = ((reason or "refused") if reason is not None else "").encode()[:MAX_REASON_BYTES]
    _send(channel, torch.tensor([int(reason is not None), len(body) if reason is not None else len(values)],
                                dtype=torch.int64), "the answer")
    if reason is not None:
        _send(channel, torch.frombuffer(bytearray(body), dtype=torch.uint8), "the answer")
    elif values:
        _send(channel, torch.tensor(values, dtype=torch.int64), "the answer")


def read_answer(channel, num_values: int) -> list[int]:
    """The receiver's `answer`: its values, or `HandoffRefused` with its reason."""
    status, n = _recv(channel, torch.zeros(2, dtype=torch.int64), "the answer").tolist()
    if status != 0:
        if not 0 <= n <= MAX_REASON_BYTES:
            raise HandoffStreamCorrupt(f"the receiver's answer is malformed: {[status, n]}")
        why = _recv(channel, torch.empty(n, dtype=torch.uint8), "the answer").numpy().tobytes().decode(errors="replace")
        raise HandoffRefused(f"the receiver refused the hand-off: {why}")
    if n != num_values:
        raise HandoffStreamCorrupt(f"the receiver answered {n} values, expected {num_values}")
    return _recv(channel, torch.empty(n, dtype=torch.int64), "the answer").tolist() if n else []
