"""A replica's compute in simulated time (the cost model's queue)."""

from __future__ import annotations

import heapq
from collections import deque


class PrefillQueue:
    """A replica's compute in simulated time: one prefill at a time (FCFS), decode batched
    beside it (each request's decode runs for its own output length once its prefill ends).

    Its load is what a live replica reports (`messages.LoadReportMsg.num_queued_tokens`):
    prompt tokens still to prefill (the running prefill's remaining share included) plus output
    tokens still to decode."""

    def __init__(self, decode_step_s: float = 0.0) -> None:
        self.decode_step_s = decode_step_s
        self.busy_until = 0.0
        self._prefills: deque[tuple[float, float, int, float]] = deque()  # (start, first, tokens, finish)
        self._num_prefill_tokens = 0  # summed over `_prefills`
        self._decoding: list[float] = []  # finish times of requests past their prefill (a heap)
        self._sum_decode_finish = 0.0

    def queued_prefill_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def _advance(self, now: float) -> None:
        prefills, decoding = self._prefills, self._decoding
        while prefills and prefills[0][1] <= now:
            _, _, tokens, finish = prefills.popleft()
            self._num_prefill_tokens -= tokens
            heapq.heappush(decoding, finish)
            self._sum_decode_finish += finish
        while decoding and decoding[0] <= now:
            self._sum_decode_finish -= heapq.heappop(decoding)

    def num_in_flight(self, now: float) -> int:
        self._advance(now)
        return len(self._prefills) + len(self._decoding)

    def queued_tokens(self, now: float) -> int:
        """Prompt tokens still to prefill + output tokens still to decode at `now`."""
        if not self._prefills and not self._decoding:  # idle (most replicas at large R)
            return 0
        self._advance(now)
        prefill = self._num_prefill_tokens
        if self._prefills:
            start, first, tokens, _ = self._prefills[0]
            if start < now:  # the running prefill: its remaining share
                prefill -= round(tokens * (now - start) / (first - start))
        decode = 0
        if self._decoding and self.decode_step_s > 0:
            decode = round((self._sum_decode_finish - len(self._decoding) * now) / self.decode_step_s)
        return prefill + max(0, decode)

    def admit(self, now: float, prefill_s: float, decode_s: float, num_prefill_tokens: int) -> tuple[float, float]:
        """Queue a prefill of `num_prefill_tokens` taking `prefill_s`; returns (first-token time,
        finish time)."""
        start = max(now, self.busy_until)
        first = start + prefill_s
        self.busy_until = first
        finish = first + decode_s
        self._prefills.append((start, first, num_prefill_tokens, finish))
        self._num_prefill_tokens += num_prefill_tokens
        return first, finish
