"""A trace's working set: the bytes a cache needs to hold everything the trace could reuse.

    KV      every distinct prompt block (a trace hash id), its tokens times the layout's attention
            bytes per token (all attention groups)
    state   one Mamba state per distinct prompt (its last block id): where `latest` retention
            keeps one, and where the next turn or a resend lands

`hybridserve simulate --memory-share F` sizes the cluster's cache memory as F times this (each of
R replicas holds F * working set / R), so budgets compare across traces and layouts.
"""

from __future__ import annotations

from collections.abc import Iterable

from cache_service.trace_sim.config import SimLayout
from cache_service.trace_sim.trace import TraceRequest


def working_set_bytes(requests: Iterable[TraceRequest], layout: SimLayout) -> int:
    groups = layout.layout.groups
    kv_per_token = sum(p / g.block_size for g, p in zip(groups, layout.page_bytes) if g.is_attention)
    state_bytes = sum(p for g, p in zip(groups, layout.page_bytes) if not g.is_attention)
    block_tokens: dict[int, int] = {}
    prompts: set[tuple[int, int]] = set()
    for req in requests:
        for i, h in enumerate(req.hash_ids):
            block_tokens[h] = min(req.block_tokens, req.input_length - i * req.block_tokens)
        if req.hash_ids:
            prompts.add((req.hash_ids[-1], req.input_length))
    return int(sum(block_tokens.values()) * kv_per_token + len(prompts) * state_bytes)
