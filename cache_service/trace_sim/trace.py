"""Mooncake-format traces (FAST'25 release): one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`, one prefix-block id per 512-token block.

Tokens are derived from the ids so that equal ids share a prefix exactly and different ids
differ from a block's first token: block id `h` is the tokens `h*512 + 1 .. h*512 + 512`
(all distinct across ids), and the last block is cut so the prompt has `input_length` tokens.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the Mooncake release's block size


class TraceError(ValueError):
    """A trace file or line is malformed (named with its line number)."""


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens per hash id (less in a scaled slice)

    def tokens(self) -> list[int]:
        out: list[int] = []
        size = self.block_tokens
        for h in self.hash_ids:
            base = h * size + 1
            out.extend(range(base, base + size))
        return out[: self.input_length]


def scale_requests(requests: Sequence[TraceRequest], scale: float = 1.0, time_scale: float = 1.0,
                   max_prompt_tokens: int | None = None) -> list[TraceRequest]:
    """A slice made to fit a small server: each 512-token block becomes `round(512 * scale)`
    tokens (the last block cut in proportion), prompts longer than `max_prompt_tokens` keep only
    their prefix (whole blocks dropped from the end), arrivals are divided by `time_scale` and
    start at 0. Equal hash ids still share exactly, so the sharing structure is the trace's."""
    if not 0 < scale <= 1:
        raise TraceError(f"--scale must be in (0, 1], got {scale}")
    if time_scale <= 0:
        raise TraceError(f"--time-scale must be positive, got {time_scale}")
    size = round(TRACE_BLOCK_TOKENS * scale)
    if size < 1:
        raise TraceError(f"--scale {scale} leaves less than one token per trace block")
    t0 = requests[0].arrival_s if requests else 0.0
    out = []
    for i, req in enumerate(requests):
        last = req.input_length - (len(req.hash_ids) - 1) * req.block_tokens  # tokens of the last block
        n = (len(req.hash_ids) - 1) * size + max(1, round(last * size / req.block_tokens))
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            if max_prompt_tokens < 2:
                raise TraceError(f"max prompt length {max_prompt_tokens} leaves no room for a prompt")
            n = max_prompt_tokens
        n = max(2, n)
        num_blocks = -(-n // size)
        out.append(TraceRequest(i, (req.arrival_s - t0) / time_scale, n, req.output_length,
                                req.hash_ids[:num_blocks], size))
    return out


def _parse(line: str, index: int, where: str, block_tokens: int) -> TraceRequest:
    try:
        obj = json.loads(line)
        req = TraceRequest(
            index=index,
            arrival_s=float(obj["timestamp"]) / 1000.0,
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=tuple(int(h) for h in obj["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{where}: bad trace record ({exc.__class__.__name__}: {exc})") from None
    need = -(-req.input_length // block_tokens)
    if req.input_length < 2 or req.output_length < 0 or any(h < 0 for h in req.hash_ids):
        raise TraceError(f"{where}: input_length must be >= 2, output_length and hash ids >= 0")
    if len(req.hash_ids) != need:
        raise TraceError(
            f"{where}: {len(req.hash_ids)} hash ids for {req.input_length} tokens; "
            f"expected {need} blocks of {block_tokens}"
        )
    return req


def iter_trace(
    path: str | Path, limit: int | None = None, block_tokens: int = TRACE_BLOCK_TOKENS
) -> Iterator[TraceRequest]:
    """Requests in file order (`.jsonl` or `.jsonl.gz`); arrivals must not decrease."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    last = 0.0
    count = 0
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            req = _parse(line, count, f"{path}:{lineno}", block_tokens)
            if req.arrival_s < last:
                raise TraceError(f"{path}:{lineno}: arrivals must not decrease ({req.arrival_s} < {last})")
            last = req.arrival_s
            count += 1
            yield req


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    return list(iter_trace(path, limit))
