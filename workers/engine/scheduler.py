"""Continuous batching with chunked prefill, a token budget per step, lazy allocation and
preemption by recompute.

One step, within `token_budget` tokens:
    1. decodes: every running request past its prefill (1 token, or 1 + k drafts to verify)
    2. prefill chunks of running requests, in priority order
    3. admissions from `waiting`, in order; one that does not fit yet is passed over (no
       head-of-line blocking) and keeps its place at the front

A prefill chunk ends at the next *stop*:

    stops = the request's checkpoint positions  U  multiples of chunk_size  U  {num_prefill_tokens}

so Mamba state is snapshotted exactly where retention wants it, and a warm run that starts at
a hit L splits [L, N) as the cold run did. When the budget left is smaller than the chunk, the
chunk is cut at the largest multiple of the alignment A that fits: every checkpoint is still a
stop of a later chunk, so retention is unchanged.

Pages are taken as a request grows (`EngineCacheManager.can_grow` / `grow`). When a pool runs
out, the lowest-priority running request (the latest arrival) not yet scheduled this step is
preempted: its pages go back (its published prefix and a snapshot stay cached), and it is
requeued at the front of `waiting` to resume with a hit. A decode with nobody below it
preempts itself; a prefill chunk with nobody below it waits.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from enum import Enum

from workers.engine.cache_manager import EngineCacheManager
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError
from workers.engine.request import Request, RequestStatus

# vLLM's serving default for max_num_batched_tokens: a burst of short prompts prefills in a few large
# steps (GEMMs of thousands of rows) instead of many steps of one chunk each
DEFAULT_TOKEN_BUDGET = 2048


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
        self.running: list[Request] = []  # priority order: earliest arrival first
        k = cache.num_spec_tokens
        default = max(DEFAULT_TOKEN_BUDGET, max(config.chunk_size, cache.alignment) + config.max_num_seqs * (k + 1))
        self.token_budget = config.max_num_batched_tokens or default
        if self.token_budget < cache.alignment + k + 1:
            raise EngineConfigError(
                f"max_num_batched_tokens={self.token_budget} must be at least the alignment {cache.alignment} "
                f"+ {k + 1} (one decode): a step could never advance a prefill")
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Take `req` as running, its pages already held (a request handed over by another engine,
        `handoff.py`): it decodes from the next step, in priority order."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self._priority)

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
        stops.append(req.num_prefill_tokens)
        return min(stops)

    def chunk_length(self, req: Request, budget: int) -> int:
        """Tokens of `req`'s next prefill chunk within `budget` (0: it waits)."""
        n = req.num_computed_tokens
        m = self.next_stop(req) - n
        if m <= budget:
            return m
        step = self.cache.alignment
        return max(0, (n + budget) // step * step - n)

    @staticmethod
    def _priority(req: Request) -> tuple[float, str]:
        return (req.arrival_s, req.request_id)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        out: list[ScheduledChunk] = []
        taken: set[str] = set()
        for req in list(self.running):  # 1. decodes first
            if req.is_prefilling or req.status is not RequestStatus.RUNNING:
                continue
            m = 1 + req.num_draft_tokens
            if m > budget or not self._make_room(req, m, decoding=True, taken=taken):
                continue
            self.cache.grow(req, m, decoding=True)
            out.append(ScheduledChunk(req, ChunkKind.VERIFY if m > 1 else ChunkKind.DECODE, m))
            taken.add(req.request_id)
            budget -= m
        for req in list(self.running):  # 2. prefill chunks of running requests
            if not req.is_prefilling or req.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            m = self.chunk_length(req, budget)
            if m and self._make_room(req, m, decoding=False, taken=taken):
                budget -= self._take_prefill(req, m, out, taken)
        passed: list[Request] = []  # 3. admissions; those that do not fit yet keep their place
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting.popleft()
            if not self.cache.try_admit(req, min(budget, self.config.chunk_size)):
                passed.append(req)
                continue
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=self._priority)
            m = self.chunk_length(req, budget)
            if m and self.cache.can_grow(req, m, decoding=False):
                budget -= self._take_prefill(req, m, out, taken)
        self.waiting.extendleft(reversed(passed))
        return out

    def _take_prefill(self, req: Request, m: int, out: list[ScheduledChunk], taken: set[str]) -> int:
        self.cache.grow(req, m, decoding=False)
        out.append(ScheduledChunk(req, ChunkKind.PREFILL, m))
        taken.add(req.request_id)
        return m

    def _make_room(self, req: Request, m: int, decoding: bool, taken: set[str]) -> bool:
        """Preempt lower-priority, not yet scheduled requests until `req` can grow by `m`.
        False when it cannot (a decode then has preempted itself)."""
        while not self.cache.can_grow(req, m, decoding):
            victims = [r for r in self.running if r.request_id not in taken and r is not req
                       and self._priority(r) > self._priority(req)]
            if victims:
                self.preempt(victims[-1])
            else:
                if decoding:
                    self.preempt(req)
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Recompute preemption: free the request's pages, requeue it at the front of `waiting`
        to prefill every token it knows (prompt + output) from its cached prefix."""
        self.cache.preempt(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_prefill_tokens = req.num_tokens
        req.num_computed_tokens = req.num_draft_computed_tokens = 0
        req.set_drafts([])  # drafts still on the device are dropped at the next read (PendingDrafts)
        req.checkpoints = req.junctions = ()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
