"""The simulated-time loop under the stepped decode model (`--decode-model stepped`; always with
`--pd-split P:D`): every replica is a `StepTimeline`, so decodes share steps with prefill chunks
(mixed) or run on their own replicas (split), and each token's time is known.

    arrival at now:
        advance the routed (mixed or prefill) timelines to now
        handle every prefill that ended by now, in time order:
            publish its blocks on its replica               (as `ClusterSim` does)
            split: pick a decode replica (pd_split.DecodePicker), price the hand-off, the stream
                   joins there when it lands; that replica publishes what it received then
        choice = policy(hashes, routed timelines, now)     (the real Router, prefill side only)
        serve  = transfer, hit, promotion                  (`ClusterSim.serve`, the same code)
        queue its prefill (N - hit tokens; transfer and promotion seconds with its first chunk)
    end: advance everything until every request has its last token

A request's TTFT, finish and inter-token latencies are read once the run ends (a later prefill
can still stall an earlier request's decode), so `run` returns the records at the end.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cache_service.block_hash import RequestBlockHashes
from cache_service.scorer import AllReplicaScorer
from cache_service.trace_sim.engine import ClusterSim, RequestRecord, Served, SimSettings
from cache_service.trace_sim.pd_split import DecodePicker, handoff_bytes
from cache_service.trace_sim.step_timeline import RequestTiming, StepTimeline
from cache_service.trace_sim.trace import TraceRequest


@dataclass(frozen=True)
class SteppedRecord(RequestRecord):
    """`ttft_s`: first token delivered (split: the hand-off included); `finish_s`: the last token."""

    decode_replica: int = -1  # split: where it decoded (-1: where it prefilled, or no decode)
    handoff_bytes: int = 0
    handoff_s: float = 0.0  # included in ttft_s
    num_itl: int = 0  # output tokens - 1
    mean_itl_s: float = 0.0
    max_itl_s: float = 0.0


@dataclass(eq=False)
class _InFlight:
    """What a request's prefill end needs: its cache side and where it ran."""

    timing: RequestTiming
    replica: int
    hashes: RequestBlockHashes
    num_tokens: int
    served: Served
    decode_replica: int = -1
    handoff_bytes: int = 0
    handoff_s: float = 0.0


class SteppedClusterSim(ClusterSim):
    def __init__(self, settings: SimSettings) -> None:
        super().__init__(settings)
        if self.policy.shared_cache:
            raise ValueError("the stepped decode model needs one cache per replica (not the oracle)")
        split = settings.pd_split
        num_routed = split.num_prefill if split is not None else settings.num_replicas
        self.itl_samples = array("d")  # every token's gap to its request's previous token
        role = "prefill" if split is not None else "mixed"
        self.timelines = [StepTimeline(settings.cost, role if i < num_routed else "decode", self.itl_samples)
                          for i in range(settings.num_replicas)]
        self.queues = self.timelines[:num_routed]  # what the policy sees
        self.picker = None
        if split is not None:
            self.picker = DecodePicker(AllReplicaScorer(self.coordinator), self.index, self.replica_ids,
                                       range(num_routed, settings.num_replicas), settings.router)
        self._flights: dict[int, _InFlight] = {}  # by timing id, until its prefill ends
        self._events: list[tuple[float, int, Callable[[], None]]] = []  # publications, by time
        self._event_seq = itertools.count()
        self._done: list[_InFlight] = []
        self.num_handoff_bytes = 0

    def step(self, req: TraceRequest, forced_replica: int | None = None) -> RequestRecord:
        raise NotImplementedError("the stepped model's records are known at the end: use run()")

    def run(self, requests: Iterable[TraceRequest],
            on_step: Callable[[RequestRecord], None] | None = None) -> list[SteppedRecord]:
        last = -math.inf
        for req in requests:
            if req.arrival_s < last:
                raise ValueError(f"request {req.index} arrives before the one before it")
            last = req.arrival_s
            self._arrive(req)
        self._settle(math.inf)
        for timeline in self.timelines:
            timeline.advance(math.inf)
        records = [self._record(f) for f in sorted(self._done, key=lambda f: f.timing.index)]
        if on_step is not None:
            for record in records:
                on_step(record)
        return records

    def _arrive(self, req: TraceRequest) -> None:
        now = req.arrival_s
        self._settle(now)
        hashes = self._hash(req)
        choice = self.policy.choose(hashes.hashes, req.input_length, self.queues, now)
        served = self.serve(req, hashes, choice)
        timing = RequestTiming(req.index, now, max(1, req.output_length))
        self._flights[id(timing)] = _InFlight(timing, choice.replica, hashes, req.input_length, served)
        cost = self.settings.cost
        self.timelines[choice.replica].admit_prefill(
            now, timing, served.num_prefill_tokens,
            cost.prefill_overhead_s + served.transfer_s + cost.promote_s(served.promoted_bytes))

    def _settle(self, now: float) -> None:
        """Advance the routed timelines to `now` and handle what ended by then, in time order."""
        for timeline in self.queues:
            for timing in timeline.advance(now):
                flight = self._flights.pop(id(timing))
                self._push(timing.prefill_end_s, lambda f=flight: self._prefill_ended(f))
        events = self._events
        while events and events[0][0] <= now:
            heapq.heappop(events)[2]()

    def _push(self, at: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (at, next(self._event_seq), action))

    def _prefill_ended(self, f: _InFlight) -> None:
        end = f.timing.prefill_end_s
        self.caches[f.replica].publish(f.hashes, f.served.hit.hit_tokens, f.num_tokens, f.served.junctions)
        self._done.append(f)
        if self.picker is None:
            return
        if f.timing.num_output_tokens == 1:  # nothing to decode: the prefill's token is the answer
            f.timing.first_token_s = f.timing.last_token_s = end
            return
        f.decode_replica, held = self.picker.pick(f.hashes.hashes, f.num_tokens, self.timelines, end)
        f.handoff_bytes = handoff_bytes(self.settings.layout, f.num_tokens, held)
        f.handoff_s = f.handoff_bytes / self.settings.cost.transfer_bytes_per_s
        self.num_handoff_bytes += f.handoff_bytes
        lands = end + f.handoff_s
        f.timing.first_token_s = f.timing.last_token_s = lands
        self.timelines[f.decode_replica].admit_stream(lands, f.timing)
        cache = self.caches[f.decode_replica]
        self._push(lands, lambda: cache.receive_transfer(f.hashes, f.num_tokens))

    def _record(self, f: _InFlight) -> SteppedRecord:
        t, s = f.timing, f.served
        if not t.finished:  # a bug: every step ran
            raise RuntimeError(f"request {t.index} did not finish ({t.num_itl} of {t.num_output_tokens - 1} gaps)")
        return SteppedRecord(
            t.index, t.arrival_s, f.replica, f.num_tokens, t.num_output_tokens, s.hit.hit_tokens,
            s.hit.attention_match_tokens, s.num_moved, t.first_token_s - t.arrival_s, t.last_token_s,
            s.hit.hit_tokens if s.promoted_bytes else 0, s.promoted_bytes, f.decode_replica, f.handoff_bytes,
            f.handoff_s, t.num_itl, t.sum_itl_s / t.num_itl if t.num_itl else 0.0, t.max_itl_s)


def make_cluster_sim(settings: SimSettings) -> ClusterSim:
    """The simulation `settings.decode_model` asks for."""
    return SteppedClusterSim(settings) if settings.decode_model == "stepped" else ClusterSim(settings)
