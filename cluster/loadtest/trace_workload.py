"""The `trace` workload: a slice of a Mooncake-format trace replayed against a live server.

    --trace FILE       Mooncake JSONL (.jsonl / .jsonl.gz), e.g. bench/traces/mooncake_synthetic_trace.jsonl.gz
    --trace-start/-limit   which requests (file order)
    --scale S          each 512-token trace block becomes round(512 * S) tokens; prompts still longer
                       than --max-model-len - max_tokens keep their prefix (`trace_sim.trace.scale_requests`,
                       the same scaling `hybridserve simulate --scale` replays)
    --time-scale T     arrivals divided by T (open loop, from the slice's first arrival)

Each trace block id maps to a fixed run of byte-tokenizer ids (seeded by the id), so requests
sharing ids share prefixes exactly, as in the simulator. max_tokens = min(output_length,
--max-tokens). A request is `warm` when its first block id appeared earlier in the slice (it
can hit), else `cold`; `group` is that first id.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from cache_service.trace_sim.trace import TraceRequest, iter_trace, scale_requests

VOCAB_LOW, VOCAB_HIGH = 3, 258  # byte-tokenizer ids (0-2 are special), within every shipped model's vocab


def trace_slice(path: str, start: int, limit: int, scale: float, time_scale: float,
                max_prompt_tokens: int) -> list[TraceRequest]:
    """Requests [start, start + limit) of the trace, scaled (`scale_requests`)."""
    if start < 0 or limit < 1:
        raise ValueError(f"trace slice needs start >= 0 and limit >= 1, got {start}, {limit}")
    requests = [r for r in iter_trace(path, start + limit) if r.index >= start]
    if not requests:
        raise ValueError(f"{path}: no requests from index {start}")
    return scale_requests(requests, scale, time_scale, max_prompt_tokens)


class BlockTokens:
    """Trace block id -> its tokens (deterministic per id and seed; memoised)."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self.seed = seed
        self._memo: dict[int, tuple[int, ...]] = {}

    def of(self, block_id: int) -> tuple[int, ...]:
        tokens = self._memo.get(block_id)
        if tokens is None:
            rng = random.Random(f"trace-block:{self.seed}:{block_id}")
            tokens = self._memo[block_id] = tuple(rng.randint(VOCAB_LOW, VOCAB_HIGH)
                                                  for _ in range(self.block_tokens))
        return tokens

    def prompt(self, req: TraceRequest) -> tuple[int, ...]:
        out: list[int] = []
        for block_id in req.hash_ids:
            out += self.of(block_id)
        return tuple(out[: req.input_length])


def trace_prompts(requests: Sequence[TraceRequest], seed: int = 0) -> list[tuple[int, ...]]:
    if not requests:
        return []
    blocks = BlockTokens(requests[0].block_tokens, seed)
    return [blocks.prompt(r) for r in requests]
