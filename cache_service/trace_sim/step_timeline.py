"""A replica's compute in simulated time, step by step (`--decode-model stepped`, `--pd-split`):
the engine's continuous batching with chunked prefill (workers/engine/scheduler.py), priced by
the cost model.

One step, starting when the previous one ends (or, idle, when work arrives):

    D      = the decoding sequences present at the step's start (each emits one token at its end)
    budget = step_token_budget - D                  (decodes first, as the engine's budget)
    chunks = the FCFS prefill queue's next tokens within the budget (several requests if one ends)
    time   = [decode_step_s + D * decode_per_seq_s if D]  +  chunk tokens / prefill_tokens_per_s
             + the fixed seconds of each prefill starting here (overhead, transfer, promotion)

so a prefill chunk sharing a step with decodes stalls every one of their tokens by the chunk's
time (the interference disaggregation removes), and a step's time grows with the batch. Without
decodes, a prefill takes exactly `CostModel.prefill_s` plus its fixed seconds, as in the legacy
queue (prefill_queue.py). A prefill's last chunk samples the request's first token at the end of
its step. Roles:

    mixed    the request then decodes here (output - 1 more tokens, from the next step on)
    prefill  no decodes: the engine hands the request off (`SteppedClusterSim`)
    decode   no prefills: streams join (`admit_stream`) at the first step starting at or after
             their hand-off lands

The timeline is advanced lazily (`advance(until)`: every step starting before `until`); a step is
atomic, so work arriving during one joins the next. A run of pure-decode steps with nothing to
join is taken in one go (the same step times, summed one by one). Each token's gap to the
request's previous token (ITL) goes to the shared `itl_samples`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import deque
from dataclasses import dataclass

from cache_service.trace_sim.config import CostModel

ROLES = ("mixed", "prefill", "decode")


@dataclass(slots=True, eq=False)
class RequestTiming:
    """One request's token times (simulated seconds, absolute); filled in as its steps run."""

    index: int
    arrival_s: float
    num_output_tokens: int  # at least 1: the prefill's token
    prefill_end_s: float = math.nan
    first_token_s: float = math.nan  # mixed: prefill_end_s; split: + the hand-off (SteppedClusterSim)
    last_token_s: float = math.nan
    num_itl: int = 0
    sum_itl_s: float = 0.0
    max_itl_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.num_itl == self.num_output_tokens - 1 and not math.isnan(self.last_token_s)


@dataclass(slots=True, eq=False)
class _Prefill:
    timing: RequestTiming
    num_left: int  # prompt tokens not yet in a step
    fixed_s: float  # paid by its first chunk
    started: bool = False


@dataclass(slots=True, eq=False)
class _Stream:
    timing: RequestTiming
    num_left: int  # tokens still to decode


class StepTimeline:
    """One replica's steps. Its load is what a live replica reports: prompt tokens not yet
    prefilled plus output tokens still to decode (streams on their way here included); read it
    after `advance(now)` (the `now` arguments exist for the policies' queue interface)."""

    def __init__(self, cost: CostModel, role: str, itl_samples: array) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        if cost.step_token_budget is None:
            raise ValueError(f"cost model {cost.name!r} has no step_token_budget: add it "
                             "(configs/sim/cost.yaml) to simulate decode steps")
        self.cost = cost
        self.role = role
        self.itl_samples = itl_samples
        self.clock = 0.0  # the end of the last step run: when the next one may start
        self.num_steps = 0
        self.num_prefill_tokens = 0  # not yet in a step
        self.num_decode_tokens = 0  # still to decode, joins included
        self._prefills: deque[_Prefill] = deque()
        self._streams: list[_Stream] = []
        self._joins: list[tuple[float, int, _Stream]] = []  # (lands at, seq, stream): a heap
        self._seq = itertools.count()

    # ---- load (the policies' queue interface) -----------------------------------------------
    def queued_tokens(self, now: float) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def num_in_flight(self, now: float) -> int:
        return len(self._prefills) + self.num_streams

    @property
    def num_streams(self) -> int:
        """Decoding sequences, those on their way here included."""
        return len(self._streams) + len(self._joins)

    # ---- work ------------------------------------------------------------------------------
    def admit_prefill(self, now: float, timing: RequestTiming, num_tokens: int, fixed_s: float) -> None:
        """Queue a prefill of `num_tokens` (after `advance(now)`), paying `fixed_s` with its first chunk."""
        if self.role == "decode":
            raise ValueError("a decode replica takes no prefills")
        if not self._prefills and not self._streams:
            self.clock = max(self.clock, now)
        self._prefills.append(_Prefill(timing, num_tokens, fixed_s))
        self.num_prefill_tokens += num_tokens

    def admit_stream(self, lands_s: float, timing: RequestTiming) -> None:
        """A handed-off request whose first token was delivered at `lands_s` decodes the rest here."""
        if self.role != "decode":
            raise ValueError(f"a {self.role} replica takes no hand-offs")
        stream = _Stream(timing, timing.num_output_tokens - 1)
        heapq.heappush(self._joins, (lands_s, next(self._seq), stream))
        self.num_decode_tokens += stream.num_left

    def advance(self, until: float) -> list[RequestTiming]:
        """Run every step that starts before `until`; the requests whose prefill ended in them."""
        done: list[RequestTiming] = []
        joins = self._joins
        while True:
            if not self._streams and not self._prefills:
                if not joins:
                    break
                self.clock = max(self.clock, joins[0][0])
            start = self.clock
            if start >= until:
                break
            while joins and joins[0][0] <= start:
                self._streams.append(heapq.heappop(joins)[2])
            if not self._prefills and self._fast_forward(until):
                continue
            self._step(start, done)
        return done

    def _step(self, start: float, done: list[RequestTiming]) -> None:
        cost, streams = self.cost, self._streams
        num_decodes = len(streams)
        step_s = cost.decode_step_s + num_decodes * cost.decode_per_seq_s if num_decodes else 0.0
        budget = self.cost.step_token_budget - num_decodes
        ended: list[_Prefill] = []
        while budget > 0 and self._prefills:
            job = self._prefills[0]
            take = min(job.num_left, budget)
            if not job.started:
                step_s += job.fixed_s
                job.started = True
            step_s += take / cost.prefill_tokens_per_s
            job.num_left -= take
            budget -= take
            self.num_prefill_tokens -= take
            if not job.num_left:
                ended.append(self._prefills.popleft())
        end = start + step_s
        self.num_steps += 1
        if streams:
            for s in streams:
                self._emit(s.timing, end - s.timing.last_token_s, end)
                s.num_left -= 1
            self.num_decode_tokens -= num_decodes
            self._streams = streams = [s for s in streams if s.num_left]
        for job in ended:
            timing = job.timing
            timing.prefill_end_s = end
            done.append(timing)
            if self.role == "mixed":
                timing.first_token_s = timing.last_token_s = end
                if timing.num_output_tokens > 1:
                    streams.append(_Stream(timing, timing.num_output_tokens - 1))
                    self.num_decode_tokens += timing.num_output_tokens - 1
        self.clock = end

    def _fast_forward(self, until: float) -> bool:
        """Pure-decode steps of the same batch, until a stream ends or the next step would start
        at or after `until` or a join: taken at once when every stream's last token came at the
        clock (else False: one ordinary step first)."""
        streams, start = self._streams, self.clock
        if any(s.timing.last_token_s != start for s in streams):
            return False
        limit = min(until, self._joins[0][0]) if self._joins else until
        step_s = self.cost.decode_step_s + len(streams) * self.cost.decode_per_seq_s
        most = min(s.num_left for s in streams)
        k, end = 0, start
        while k < most and end < limit:  # a step may start here; the same sums as one by one
            end += step_s
            k += 1
        if k < 2:
            return False
        self.num_steps += k
        self.itl_samples.frombytes(array("d", [step_s]).tobytes() * (k * len(streams)))
        for s in streams:
            t = s.timing
            t.num_itl += k
            t.sum_itl_s += k * step_s
            t.max_itl_s = max(t.max_itl_s, step_s)
            t.last_token_s = end
            s.num_left -= k
        self.num_decode_tokens -= k * len(streams)
        self._streams = [s for s in streams if s.num_left]
        self.clock = end
        return True

    def _emit(self, timing: RequestTiming, itl: float, at: float) -> None:
        self.itl_samples.append(itl)
        timing.num_itl += 1
        timing.sum_itl_s += itl
        timing.max_itl_s = max(timing.max_itl_s, itl)
        timing.last_token_s = at
