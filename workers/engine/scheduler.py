"""Continuous batching with chunked prefill.

Each step takes every running decode (1 token, or 1 + k drafts to verify) and then prefill
chunks within the token budget. A prefill chunk always ends at the next *stop*:

    stops = the request's checkpoint positions  U  multiples of chunk_size  U  {N}

so Mamba state is snapshotted exactly where retention wants it, and a warm run that starts at
a hit L splits [L, N) exactly as the cold run did (same shapes, same floats). A chunk that does
not fit the remaining budget waits for the next step rather than ending somewhere else.
Admission is check-then-act (`EngineCacheManager.try_admit`), FCFS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from workers.engine.cache_manager import EngineCacheManager
from workers.engine.config import EngineConfig
from workers.engine.request import Request, RequestStatus


class ChunkKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass(frozen=True)
class ScheduledChunk:
    req: Request
    kind: ChunkKind
    num_new_tokens: int


class Scheduler:
    def __init__(self, config: EngineConfig, cache: EngineCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        k = config.num_spec_tokens if cache.speculative else 0
        self.token_budget = config.chunk_size + config.max_num_seqs * (k + 1)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def next_stop(self, req: Request) -> int:
        n, size = req.num_computed_tokens, self.config.chunk_size
        stops = [c for c in req.checkpoints if c > n]
        stops.append((n // size + 1) * size)
        stops.append(req.num_prompt_tokens)
        return min(stops)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        out: list[ScheduledChunk] = []
        for req in self.running:
            if not req.is_prefilling:
                m = 1 + len(req.draft_token_ids)
                out.append(ScheduledChunk(req, ChunkKind.VERIFY if m > 1 else ChunkKind.DECODE, m))
                budget -= m
        for req in self.running:
            if req.is_prefilling:
                m = self.next_stop(req) - req.num_computed_tokens
                if m <= budget:
                    out.append(ScheduledChunk(req, ChunkKind.PREFILL, m))
                    budget -= m
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.cache.try_admit(req):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            m = self.next_stop(req) - req.num_computed_tokens
            if m <= budget:
                out.append(ScheduledChunk(req, ChunkKind.PREFILL, m))
                budget -= m
        return out
